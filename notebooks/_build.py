# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
# The cells below are ruff-formatted to the notebooks' 88 columns; indented
# here by 8 more, their lines may run to 96.
# ruff: noqa: E501
"""Generates the Colab notebooks in this folder; edit them here, then rerun.

``python notebooks/_build.py`` rewrites every notebook, stripped of outputs.
``python notebooks/_build.py --check`` exits non-zero if a stored notebook
differs from what this script generates (tests/test_notebooks.py runs it too).

Cell ids are derived from the notebook name and position, so regenerating an
unchanged notebook gives byte-identical JSON and a clean git diff.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
REPO_URL = "https://github.com/optax-accum/optax_accum"
COLAB_URL = "https://colab.research.google.com/github/optax-accum/optax_accum/blob/main/notebooks"
BADGE_IMG = "https://colab.research.google.com/assets/colab-badge.svg"

Cell = tuple[str, str]


def md(text: str) -> Cell:
    return ("markdown", textwrap.dedent(text).strip())


def code(text: str) -> Cell:
    return ("code", textwrap.dedent(text).strip())


def badge(name: str) -> str:
    return f"[![Open In Colab]({BADGE_IMG})]({COLAB_URL}/{name}.ipynb)"


def header(name: str, title: str, intro: str) -> list[Cell]:
    """Title, badge, the install cell and the cell that reports the devices."""
    return [
        md(f"# {title}\n\n{badge(name)}\n\n{textwrap.dedent(intro).strip()}"),
        code(
            f"""
            # On Colab this installs optax_accum. Where it already imports (a local
            # checkout, CI) the cell does nothing and needs no network.
            import importlib.util

            if importlib.util.find_spec("optax_accum") is None:
                %pip install -q "optax_accum[examples] @ git+{REPO_URL}"
            """
        ),
    ]


DEVICES = code(
    """
    import jax

    # TPUs multiply float32 matrices in bfloat16 passes by default; the exactness
    # checks below compare float32 results, so ask for full precision.
    jax.config.update("jax_default_matmul_precision", "highest")

    BACKEND = jax.default_backend()
    FULL = BACKEND != "cpu"  # small sizes on the CPU, full sizes on a TPU or GPU
    print(f"JAX {jax.__version__}, backend {BACKEND!r}, {jax.device_count()} device(s):")
    for device in jax.devices():
        print("   ", device)
    """
)


# --------------------------------------------------------------------------
# 01: quickstart
# --------------------------------------------------------------------------

QUICKSTART = [
    *header(
        "01_quickstart",
        "optax_accum quickstart",
        """
        `optax_accum.accumulate` wraps any optax optimizer so that it sees the
        mean gradient of `k` micro-batches as one step. This notebook shows

        1. `accumulate` around an optax chain (clipping and AdamW),
        2. that `k` accumulated micro-steps give the same parameters as one step on
           the `k`-times larger batch, and
        3. migrating from `optax.MultiSteps` by changing one import.
        """,
    ),
    DEVICES,
    md(
        """
        ## A small regression problem

        A two-layer MLP fitted to a noisy nonlinear target. Sizes depend on the
        backend: a few seconds on a laptop CPU, larger on a TPU or GPU.
        """
    ),
    code(
        """
        import jax.numpy as jnp
        import optax

        import optax_accum

        K = 4  # micro-batches per optimizer update
        MICRO_BATCH = 512 if FULL else 32
        NUM_UPDATES = 50 if FULL else 15
        DIM, HIDDEN = (256, 1024) if FULL else (16, 64)

        k_x, k_w, k_noise, k_init = jax.random.split(jax.random.key(0), 4)
        num_examples = NUM_UPDATES * K * MICRO_BATCH
        x = jax.random.normal(k_x, (num_examples, DIM))
        w_true = jax.random.normal(k_w, (DIM,)) / jnp.sqrt(DIM)
        y = jnp.sin(3 * x @ w_true) + 0.1 * jax.random.normal(k_noise, (num_examples,))


        def init_params(key):
            k1, k2 = jax.random.split(key)
            return {
                "w1": jax.random.normal(k1, (DIM, HIDDEN)) / jnp.sqrt(DIM),
                "b1": jnp.zeros(HIDDEN),
                "w2": jax.random.normal(k2, (HIDDEN,)) / jnp.sqrt(HIDDEN),
            }


        def loss_fn(params, x, y):
            hidden = jax.nn.gelu(x @ params["w1"] + params["b1"])
            return jnp.mean((hidden @ params["w2"] - y) ** 2)


        def make_optimizer():
            return optax.chain(
                optax.clip_by_global_norm(1.0),
                optax.adamw(3e-3, weight_decay=1e-4),
            )


        params0 = init_params(k_init)
        print(f"{num_examples} examples, {K} micro-batches of {MICRO_BATCH} per update")
        """
    ),
    md(
        """
        ## `accumulate` in an optax chain

        Wrap the whole chain: clipping and AdamW then see one accumulated gradient
        per update, so the clipping threshold, Adam's moment estimates, its step
        count and the weight decay all count optimizer steps, not micro-steps.
        On the `k - 1` hold steps the updates are exact zeros.
        """
    ),
    code(
        """
        tx = optax_accum.accumulate(make_optimizer(), every_k=K)


        @jax.jit
        def micro_step(params, state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss


        def micro_batches(update):
            start = update * K * MICRO_BATCH
            for i in range(K):
                lo = start + i * MICRO_BATCH
                yield x[lo : lo + MICRO_BATCH], y[lo : lo + MICRO_BATCH]


        params, state = params0, tx.init(params0)
        windows = []  # per update: (params, inner optimizer state) before, params after
        for update in range(NUM_UPDATES):
            before = (params, state.inner_state)
            for i, (xb, yb) in enumerate(micro_batches(update)):
                params, state, loss = micro_step(params, state, xb, yb)
                if update == 0:
                    print(
                        f"micro-batch {i + 1}/{K}: loss {float(loss):.4f}, "
                        f"updated={bool(optax_accum.has_updated(state))}"
                    )
            windows.append((before, params))
        print(f"optimizer updates: {int(state.update_step)}, final micro-batch loss {loss:.4f}")
        """
    ),
    md(
        """
        ## Each update equals one large-batch step

        The reference: the same optimizer taking one step on all `K * MICRO_BATCH`
        examples of the window, from the same parameters and optimizer state.
        Every micro-batch has the same size and the loss is a mean, so the mean of
        the `K` micro-batch gradients is the large-batch gradient, and the two
        must agree to float32 rounding, for every one of the updates.
        """
    ),
    code(
        """
        big_tx = make_optimizer()


        @jax.jit
        def big_step(params, state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, state = big_tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, loss


        def relative_distance(a, b):
            # ‖a - b‖ / ‖b‖ over all leaves; float32 rounding is about 1e-7.
            a, b = jax.tree.leaves(a), jax.tree.leaves(b)
            num = sum(jnp.sum((x - y) ** 2) for x, y in zip(a, b, strict=True))
            return float(jnp.sqrt(num / sum(jnp.sum(y**2) for y in b)))


        size = K * MICRO_BATCH
        distances = []
        for update, ((params, inner_state), after) in enumerate(windows):
            window = slice(update * size, (update + 1) * size)
            expected, _, big_loss = big_step(params, inner_state, x[window], y[window])
            distances.append(relative_distance(after, expected))
            if update % 5 == 4:
                print(
                    f"update {update + 1:3d}: large-batch loss {float(big_loss):.4f}, "
                    f"relative distance to accumulate {distances[-1]:.1e}"
                )
        assert max(distances) < 1e-5, max(distances)
        print(f"accumulate(k={K}) == one large-batch step, for all {NUM_UPDATES} updates")
        """
    ),
    md(
        """
        Two separate float32 runs, one accumulated and one on large batches, start
        out as close as this, then drift apart slowly, as any two runs that add the
        same numbers in a different order do: Adam divides by the gradient's RMS,
        which magnifies last-bit differences where a gradient is almost zero.
        Notebook 02 plots such trajectories.
        """
    ),
    md(
        """
        ## Migrating from `optax.MultiSteps`

        `optax_accum.MultiSteps` takes the same arguments, has the same methods and
        optax's state fields (plus one of its own, after them, with a default), so
        migrating is one changed name:

        ```python
        opt = optax.MultiSteps(optimizer, every_k_schedule=K)        # before
        opt = optax_accum.MultiSteps(optimizer, every_k_schedule=K)  # after
        ```

        The inner optimizer then runs only on the boundary steps, inside one
        `lax.cond`; `optax.MultiSteps` runs it on every micro-step and keeps the
        result on the last one. Below, the same loop with either class:
        """
    ),
    code(
        """
        def run_multisteps(multi_steps_cls, num_micro_steps):
            opt = multi_steps_cls(make_optimizer(), every_k_schedule=K)

            @jax.jit
            def step(params, state, x, y):
                grads = jax.grad(loss_fn)(params, x, y)
                updates, state = opt.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            params, state = params0, opt.init(params0)
            for i in range(num_micro_steps):
                lo = i * MICRO_BATCH
                params, state = step(
                    params, state, x[lo : lo + MICRO_BATCH], y[lo : lo + MICRO_BATCH]
                )
            return params, state, opt


        steps = 3 * K + 1  # three updates and one micro-batch into the fourth window
        optax_params, optax_state, _ = run_multisteps(optax.MultiSteps, steps)
        ours_params, ours_state, ours = run_multisteps(optax_accum.MultiSteps, steps)

        # optax's fields, in order; ours adds `acc_value` (the window's loss, `()`
        # unless the optimizer reads `value`), with a default.
        n = len(type(optax_state)._fields)
        assert type(ours_state)._fields[:n] == type(optax_state)._fields
        print("state fields:", type(ours_state)._fields)
        assert relative_distance(ours_params, optax_params) < 1e-5
        assert relative_distance(ours_state.acc_grads, optax_state.acc_grads) < 1e-5
        print(
            f"gradient_step={int(ours_state.gradient_step)}, "
            f"mini_step={int(ours_state.mini_step)}"
        )
        print("optax.MultiSteps and optax_accum.MultiSteps agree")
        """
    ),
    md(
        """
        Because the state fields and their meaning match, a state saved by
        `optax.MultiSteps`, even in the middle of a window, continues in
        `optax_accum.MultiSteps`:
        """
    ),
    code(
        """
        restored = optax_accum.MultiStepsState(*optax_state)
        grads = jax.grad(loss_fn)(optax_params, x[:MICRO_BATCH], y[:MICRO_BATCH])
        _, from_optax = ours.update(grads, restored, optax_params)
        _, from_ours = ours.update(grads, ours_state, ours_params)
        assert int(from_optax.mini_step) == int(from_ours.mini_step) == 2
        assert relative_distance(from_optax.acc_grads, from_ours.acc_grads) < 1e-5
        assert relative_distance(from_optax.inner_opt_state, from_ours.inner_opt_state) < 1e-5
        print(
            "resumed an optax.MultiSteps state mid-window:", int(from_optax.mini_step), "of", K
        )
        """
    ),
    md(
        """
        ## Next

        * [02_token_weighting](02_token_weighting.ipynb): exact token-weighted
          accumulation for padded sequences, with a Flax nnx language model.
        * [03_memory](03_memory.ipynb): how much memory a micro-batch size needs.
        * [04_pod_scale](04_pod_scale.ipynb): `optax_accum.microbatch` on a
          sharded mesh of 8 devices.
        """
    ),
]


# --------------------------------------------------------------------------
# 02: token weighting
# --------------------------------------------------------------------------

TOKEN_WEIGHTING = [
    *header(
        "02_token_weighting",
        "Exact token-weighted accumulation for padded sequences",
        """
        A language model's loss is a mean over *valid tokens*. When micro-batches
        hold different numbers of valid tokens (padded, variable-length
        sequences, bucketed by length), the plain mean of the micro-batch losses
        (mean-of-means, what `optax.MultiSteps` computes) is not the large-batch
        loss: it over-weights the tokens of short micro-batches.

        `optax_accum.accumulate` takes a `weight` per micro-batch. With the
        number of valid tokens as the weight, the accumulated gradient is exactly
        the large-batch token-mean gradient. This notebook trains a small Flax
        nnx character-level transformer three ways and plots how far each
        accumulated run drifts from the true large batch.
        """,
    ),
    DEVICES,
    md(
        """
        ## Data: generated sentences, no download

        A tiny grammar generates sentences of very different lengths. Each
        update draws `K * MICRO_BATCH` of them, sorts them by length (bucketing,
        as length-aware data loaders do) and cuts them into `K` padded
        micro-batches, so the micro-batches hold very different token counts.
        """
    ),
    code(
        """
        import matplotlib.pyplot as plt
        import numpy as np
        import optax
        from flax import nnx
        from jax import numpy as jnp

        import optax_accum

        K = 4  # micro-batches per update
        MICRO_BATCH = 32 if FULL else 8  # sequences per micro-batch
        SEQ_LEN = 256 if FULL else 96
        NUM_UPDATES = 100 if FULL else 20
        D_MODEL, NUM_HEADS, NUM_LAYERS = (256, 8, 4) if FULL else (64, 4, 2)
        PEAK_LR = 1e-3 if FULL else 3e-3

        SUBJECTS = ["the cat", "a small dog", "my neighbour", "the old sailor", "a robot"]
        VERBS = ["sees", "likes", "paints", "follows", "remembers", "builds", "sells"]
        OBJECTS = ["a red boat", "the moon", "an apple", "the long river", "two birds"]
        EXTRAS = [
            "at night",
            "in the garden",
            "because it is raining",
            "while the band plays a slow song",
            "near the station",
            "every morning",
        ]


        def sentence(rng):
            clauses = []
            for _ in range(rng.choice([1, 1, 2, 3, 4])):
                words = [rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)]
                words += rng.choice(EXTRAS, size=rng.integers(0, 3), replace=False).tolist()
                clauses.append(" ".join(words))
            return " and ".join(clauses) + "."


        CHARS = sorted(set("".join(SUBJECTS + VERBS + OBJECTS + EXTRAS) + " ."))
        PAD, BOS, EOS = 0, 1, 2
        VOCAB = len(CHARS) + 3
        STOI = {c: i + 3 for i, c in enumerate(CHARS)}


        def encode(texts):
            # Inputs start with BOS, targets end with EOS; the mask marks valid tokens.
            shape = (len(texts), SEQ_LEN)
            tokens, targets = np.full(shape, PAD, np.int32), np.full(shape, PAD, np.int32)
            mask = np.zeros(shape, np.float32)
            for row, text in enumerate(texts):
                ids = ([BOS] + [STOI[c] for c in text] + [EOS])[: SEQ_LEN + 1]
                n = len(ids) - 1
                tokens[row, :n], targets[row, :n], mask[row, :n] = ids[:-1], ids[1:], 1
            return tokens, targets, mask


        rng = np.random.default_rng(0)
        updates = []  # per update: K micro-batches of (tokens, targets, mask)
        for _ in range(NUM_UPDATES):
            texts = sorted((sentence(rng) for _ in range(K * MICRO_BATCH)), key=len)
            tokens, targets, mask = encode(texts)
            cuts = [slice(i * MICRO_BATCH, (i + 1) * MICRO_BATCH) for i in range(K)]
            updates.append([(tokens[c], targets[c], mask[c]) for c in cuts])

        print("example:", repr(sentence(rng)))
        print(
            "valid tokens per micro-batch in update 0:", [int(mb[2].sum()) for mb in updates[0]]
        )
        """
    ),
    md(
        """
        ## Model: a small causal transformer in Flax nnx
        """
    ),
    code(
        """
        class Block(nnx.Module):
            def __init__(self, rngs):
                self.norm1 = nnx.LayerNorm(D_MODEL, rngs=rngs)
                self.attention = nnx.MultiHeadAttention(
                    NUM_HEADS, D_MODEL, decode=False, keep_rngs=False, rngs=rngs
                )
                self.norm2 = nnx.LayerNorm(D_MODEL, rngs=rngs)
                self.up = nnx.Linear(D_MODEL, 4 * D_MODEL, rngs=rngs)
                self.down = nnx.Linear(4 * D_MODEL, D_MODEL, rngs=rngs)

            def __call__(self, x, mask):
                x = x + self.attention(self.norm1(x), mask=mask)
                return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


        class CharLM(nnx.Module):
            def __init__(self, rngs):
                self.embed = nnx.Embed(VOCAB, D_MODEL, rngs=rngs)
                self.position = nnx.Param(
                    0.02 * jax.random.normal(rngs.params(), (SEQ_LEN, D_MODEL))
                )
                self.blocks = nnx.List([Block(rngs) for _ in range(NUM_LAYERS)])
                self.norm = nnx.LayerNorm(D_MODEL, rngs=rngs)
                self.head = nnx.Linear(D_MODEL, VOCAB, rngs=rngs)

            def __call__(self, tokens):
                x = self.embed(tokens) + self.position[...]
                mask = nnx.make_causal_mask(tokens)  # padding only follows valid tokens
                for block in self.blocks:
                    x = block(x, mask)
                return self.head(self.norm(x))


        def loss_fn(model, tokens, targets, mask):
            # Token-mean cross-entropy of one (micro-)batch: padding does not count.
            logits = model(tokens)
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
            return jnp.sum(losses * mask) / jnp.sum(mask)


        def new_model():
            return CharLM(nnx.Rngs(0))  # the same initial parameters for every run


        num_params = sum(p.size for p in jax.tree.leaves(nnx.state(new_model(), nnx.Param)))
        print(f"{num_params:,} parameters, vocabulary {VOCAB}, sequences of up to {SEQ_LEN}")
        """
    ),
    md(
        """
        ## One accumulated gradient, two weightings

        `accumulate(optax.identity(), K)` emits the accumulated gradient itself
        on the `K`-th call. Weighting each micro-batch by its number of valid
        tokens reproduces the large-batch gradient; unit weights do not.
        """
    ),
    code(
        """
        def concat(micro_batches):
            return tuple(np.concatenate(parts) for parts in zip(*micro_batches, strict=True))


        gradient = nnx.jit(nnx.grad(loss_fn))
        sum_gradients = optax_accum.accumulate(optax.identity(), every_k=K)


        @nnx.jit
        def add_micro_batch(model, state, tokens, targets, mask, weight):
            grads = nnx.grad(loss_fn)(model, tokens, targets, mask)
            return sum_gradients.update(grads, state, weight=weight)


        def accumulated_gradient(model, micro_batches, token_weighted):
            state = sum_gradients.init(nnx.state(model, nnx.Param))
            for tokens, targets, mask in micro_batches:
                weight = jnp.float32(mask.sum() if token_weighted else 1.0)
                out, state = add_micro_batch(model, state, tokens, targets, mask, weight)
            assert optax_accum.has_updated(state)
            return out


        @jax.jit
        def relative_distance(a, b):
            a, b = jax.tree.leaves(a), jax.tree.leaves(b)
            num = sum(jnp.sum((x - y) ** 2) for x, y in zip(a, b, strict=True))
            return jnp.sqrt(num / sum(jnp.sum(y**2) for y in b))


        model = new_model()
        large = gradient(model, *concat(updates[0]))
        exact = accumulated_gradient(model, updates[0], token_weighted=True)
        mean_of_means = accumulated_gradient(model, updates[0], token_weighted=False)
        print(f"token-weighted: relative error {relative_distance(exact, large):.1e}")
        print(f"mean-of-means:  relative error {relative_distance(mean_of_means, large):.1e}")
        assert relative_distance(exact, large) < 1e-5
        assert relative_distance(mean_of_means, large) > 1e-3
        """
    ),
    md(
        """
        Inside one jitted step, `optax_accum.microbatch` loops over the `K`
        micro-batches itself (a `lax.scan`) and takes the same weights through
        `weight_fn`, which sees each micro-batch's slices of the batch arguments:
        """
    ),
    code(
        """
        graphdef, state = nnx.split(model)


        def pure_loss(state, tokens, targets, mask):
            return loss_fn(nnx.merge(graphdef, state), tokens, targets, mask)


        fused = jax.jit(
            optax_accum.microbatch(
                jax.value_and_grad(pure_loss),
                K,
                batch_argnums=(1, 2, 3),
                weight_fn=lambda tokens, targets, mask: mask.sum(),
            )
        )
        _, fused_grads = fused(state, *concat(updates[0]))
        fused_error = relative_distance(fused_grads, large)
        print(f"microbatch with weight_fn: relative error {fused_error:.1e}")
        assert fused_error < 1e-5
        """
    ),
    md(
        """
        ## Training: large batch, token-weighted and mean-of-means

        Three runs from the same initial parameters on the same data. The
        accumulated runs use `nnx.Optimizer` with `accumulate`: its `update`
        forwards `weight=` to the transformation.
        """
    ),
    code(
        """
        def make_optimizer():
            # The schedule counts optimizer updates: `accumulate` runs the inner
            # optimizer once per K micro-batches.
            learning_rate = optax.warmup_cosine_decay_schedule(
                PEAK_LR / 10, PEAK_LR, NUM_UPDATES // 10, decay_steps=NUM_UPDATES
            )
            return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate))


        @nnx.jit
        def large_step(model, optimizer, tokens, targets, mask):
            loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, targets, mask)
            optimizer.update(model, grads)
            return loss


        @nnx.jit
        def micro_step(model, optimizer, tokens, targets, mask, weight):
            loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, targets, mask)
            optimizer.update(model, grads, weight=weight)
            return loss


        def new_run(tx):
            model = new_model()
            return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


        # One transformation for both accumulated runs (it holds no state), so
        # micro_step compiles once.
        accumulated_tx = optax_accum.accumulate(make_optimizer(), every_k=K)
        runs = {
            "large batch": new_run(make_optimizer()),
            "token-weighted": new_run(accumulated_tx),
            "mean-of-means": new_run(accumulated_tx),
        }

        history = {name: {"loss": [], "distance": []} for name in runs}
        for micro_batches in updates:
            model, optimizer = runs["large batch"]
            history["large batch"]["loss"].append(
                float(large_step(model, optimizer, *concat(micro_batches)))
            )
            for name in ["token-weighted", "mean-of-means"]:
                model, optimizer = runs[name]
                losses, tokens = [], []
                for batch in micro_batches:
                    num_tokens = batch[2].sum()
                    weight = num_tokens if name == "token-weighted" else 1.0
                    losses.append(
                        float(micro_step(model, optimizer, *batch, jnp.float32(weight)))
                    )
                    tokens.append(num_tokens)
                # The large-batch loss of this run's parameters: a token-weighted mean.
                history[name]["loss"].append(np.average(losses, weights=tokens))
            reference = nnx.state(runs["large batch"][0], nnx.Param)
            for name in runs:
                history[name]["distance"].append(
                    float(relative_distance(nnx.state(runs[name][0], nnx.Param), reference))
                )

        for name, h in history.items():
            print(
                f"{name:>15}: final loss {h['loss'][-1]:.4f}, "
                f"distance to the large batch {h['distance'][-1]:.1e}"
            )
        """
    ),
    code(
        """
        steps = np.arange(1, NUM_UPDATES + 1)
        fig, (ax_dist, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
        for name, style in [("token-weighted", "-"), ("mean-of-means", "--")]:
            ax_dist.semilogy(steps, history[name]["distance"], style, label=name)
            gap = np.abs(np.subtract(history[name]["loss"], history["large batch"]["loss"]))
            ax_loss.semilogy(steps, np.maximum(gap, 1e-9), style, label=name)
        ax_dist.set(
            xlabel="update",
            ylabel="‖θ - θ_large‖ / ‖θ_large‖",
            title="Parameter distance to the large batch",
        )
        ax_loss.set(
            xlabel="update", ylabel="|loss - loss_large|", title="Loss gap to the large batch"
        )
        for ax in (ax_dist, ax_loss):
            ax.legend()
            ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        plt.show()
        """
    ),
    md(
        """
        The token-weighted run follows the large batch up to float32 rounding:
        the two sum the same per-token gradients in a different order. Adam
        divides by the gradient's running RMS, which magnifies those last-bit
        differences where a gradient is close to zero, so the distance grows
        slowly, but it stays orders of magnitude below the bias of mean-of-means.
        """
    ),
    code(
        """
        exact_drift = max(history["token-weighted"]["distance"])
        biased_drift = history["mean-of-means"]["distance"][-1]
        print(f"token-weighted stays within {exact_drift:.1e} of the large batch")
        print(
            f"mean-of-means ends {biased_drift:.1e} away, "
            f"{biased_drift / exact_drift:,.0f}x further"
        )
        assert exact_drift < 1e-3
        assert biased_drift > 30 * exact_drift
        """
    ),
    md(
        """
        **Takeaway.** Pass `weight=num_valid_tokens` to `update` whenever a
        micro-batch's loss is a mean over a variable number of items (tokens,
        unmasked pixels, non-padded examples). It costs nothing and makes the
        accumulated step the large-batch step.
        """
    ),
]


# --------------------------------------------------------------------------
# 03: memory
# --------------------------------------------------------------------------

MEMORY = [
    *header(
        "03_memory",
        "How much memory does a micro-batch need?",
        """
        Gradient accumulation trades time for memory: `k` micro-batches of size
        `b` need the activations of `b` examples, not `k * b`. This notebook
        measures it without running anything: each step is compiled ahead of
        time for abstract shapes and XLA's memory analysis
        (`jax.jit(f).lower(...).compile().memory_analysis()`) reports its
        argument, output and temporary bytes. Then it asks which micro-batch
        size fits a memory budget.

        Three ways to take one optimizer step on `k * b` examples:

        * **accumulate**: `k` calls of a jitted step on `b` examples each, with
          `optax_accum.accumulate` (the batch streams in one micro-batch at a
          time);
        * **microbatch**: one jitted step on the whole `k * b` batch that loops
          over `k` micro-batches with `optax_accum.microbatch` (a `lax.scan`);
        * **full batch**: one step on `k * b` examples, no accumulation.
        """,
    ),
    DEVICES,
    code(
        """
        import functools
        import math

        import matplotlib.pyplot as plt
        import matplotlib.ticker
        import optax
        from jax import numpy as jnp

        import optax_accum

        DIM, HIDDEN, LAYERS, CLASSES = (1024, 4096, 4, 1000) if FULL else (64, 512, 3, 10)
        MiB = 2**20


        def init_params(key):
            sizes = [DIM] + [HIDDEN] * LAYERS + [CLASSES]
            keys = jax.random.split(key, len(sizes) - 1)
            return [
                {"w": jax.random.normal(k, (m, n)) / math.sqrt(m), "b": jnp.zeros(n)}
                for k, m, n in zip(keys, sizes[:-1], sizes[1:], strict=True)
            ]


        def loss_fn(params, batch):
            h = batch["x"]
            for layer in params[:-1]:
                h = jax.nn.gelu(h @ layer["w"] + layer["b"])
            logits = h @ params[-1]["w"] + params[-1]["b"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


        params = init_params(jax.random.key(0))
        example = {"x": jnp.zeros(DIM), "y": jnp.zeros([], jnp.int32)}
        num_params = sum(p.size for p in jax.tree.leaves(params))
        print(f"{num_params:,} parameters ({4 * num_params / MiB:.1f} MiB in float32)")
        """
    ),
    md(
        """
        ## The three steps

        Each step donates its parameters and optimizer state, as a real training
        loop does, so updated buffers reuse the old ones (XLA reports them as
        aliased).
        """
    ),
    code(
        """
        def accumulate_step(k):
            tx = optax_accum.accumulate(optax.adamw(1e-3), every_k=k)

            def step(params, state, batch):
                grads = jax.grad(loss_fn)(params, batch)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            return jax.jit(step, donate_argnums=(0, 1)), tx.init(params)


        def microbatch_step(k):  # k = 1 is the full-batch step
            tx = optax.adamw(1e-3)
            grad_fn = optax_accum.microbatch(jax.value_and_grad(loss_fn), k)

            def step(params, state, batch):
                _, grads = grad_fn(params, batch)
                updates, state = tx.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            return jax.jit(step, donate_argnums=(0, 1)), tx.init(params)


        def batch_of(size):
            return jax.tree.map(
                lambda x: jax.ShapeDtypeStruct((size, *x.shape), x.dtype), example
            )


        @functools.cache
        def memory(method, k, size):
            # XLA's memory analysis of one step of `method`, compiled for `size` examples.
            step, state = accumulate_step(k) if method == "accumulate" else microbatch_step(k)
            compiled = step.lower(params, state, batch_of(size)).compile()
            stats = compiled.memory_analysis()
            return {
                "temp": stats.temp_size_in_bytes,
                "argument": stats.argument_size_in_bytes,
                "output": stats.output_size_in_bytes,
                "alias": stats.alias_size_in_bytes,
                "peak": optax_accum.compiled_memory_bytes(compiled),  # arg + out - alias + temp
            }


        def per_update(method, k, b):
            # The memory of one update made of k micro-batches of b examples.
            if method == "accumulate":
                # k calls of one step on b examples; k is a constant inside it that
                # does not change its buffers, so one k (K, below) stands for all.
                return memory("accumulate", K, b)
            return memory("microbatch", k if method == "microbatch" else 1, k * b)


        K = 8
        m = per_update("accumulate", K, 64)
        print(
            "accumulate step, 64 examples:", {key: f"{v / MiB:.2f} MiB" for key, v in m.items()}
        )
        """
    ),
    md(
        """
        ## Peak memory against the micro-batch size and against `k`
        """
    ),
    code(
        """
        METHODS = ["accumulate", "microbatch", "full batch"]
        SIZES = [16, 64, 256, 1024]  # the sweep over b, with k = K
        B, KS = 64, [1, 2, 8, 32]  # the sweep over k
        if FULL:
            SIZES, B = [64, 256, 1024, 4096], 1024

        by_size = {name: [per_update(name, K, b) for b in SIZES] for name in METHODS}
        by_k = {name: [per_update(name, k, B) for k in KS] for name in METHODS}

        print(
            f"{'b':>6} {'method':>11} {'temp':>10} {'argument':>10} {'output':>10} "
            f"{'peak':>10}  (MiB, k={K})"
        )
        for i, b in enumerate(SIZES):
            for name, rows in by_size.items():
                r = {key: v / MiB for key, v in rows[i].items()}
                print(
                    f"{b:6d} {name:>11} {r['temp']:10.2f} {r['argument']:10.2f} "
                    f"{r['output']:10.2f} {r['peak']:10.2f}"
                )
        """
    ),
    code(
        """
        fig, (ax_b, ax_k) = plt.subplots(1, 2, figsize=(12, 4.5))
        styles = {
            "accumulate": ("C0", "o"),
            "microbatch": ("C1", "s"),
            "full batch": ("C2", "^"),
        }
        for name, (color, marker) in styles.items():
            for ax, xs, rows in [(ax_b, SIZES, by_size[name]), (ax_k, KS, by_k[name])]:
                ax.plot(
                    xs,
                    [r["peak"] / MiB for r in rows],
                    "-",
                    color=color,
                    marker=marker,
                    label=f"{name}: peak",
                )
                ax.plot(
                    xs,
                    [r["temp"] / MiB for r in rows],
                    ":",
                    color=color,
                    marker=marker,
                    alpha=0.5,
                    label=f"{name}: temp",
                )
        ax_b.set(xlabel="micro-batch size b", title=f"k = {K}: {K}·b examples per update")
        ax_k.set(
            xlabel="micro-batches per update k", title=f"b = {B}: k·{B} examples per update"
        )
        for ax in (ax_b, ax_k):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.set_ylabel("MiB")
            ax.grid(True, which="both", alpha=0.3)
        ax_b.legend(fontsize=8)
        fig.tight_layout()
        plt.show()
        """
    ),
    md(
        """
        What the plots show:

        * **full batch**: temporary memory (the activations kept for the
          backward pass) grows linearly with the number of examples per update.
        * **microbatch**: temporary memory is that of one micro-batch plus one
          gradient accumulator, whatever `k`; only the input batch (an argument)
          grows with `k`.
        * **accumulate**: one call sees one micro-batch, so nothing grows with
          `k`; the accumulator lives in the optimizer state (one extra copy of
          the parameters).
        """
    ),
    code(
        """
        temp_k = [r["temp"] for r in by_k["microbatch"]]
        assert max(temp_k[1:]) <= 1.1 * temp_k[1], "microbatch temp memory must not grow with k"
        full_temp = [r["temp"] for r in by_k["full batch"]]
        assert full_temp[-1] > 4 * full_temp[1], "full-batch temp memory grows with the batch"
        print(
            f"microbatch temp, k={KS[1]}..{KS[-1]}: "
            f"{[round(t / MiB, 2) for t in temp_k[1:]]} MiB"
        )
        print(
            f"full batch temp, same batches:  {[round(t / MiB, 2) for t in full_temp[1:]]} MiB"
        )
        """
    ),
    md(
        """
        ## What fits a given budget?

        `optax_accum.plan_micro_batch` does this search for you: a binary
        search over micro-batch sizes, each one compiled ahead of time and never
        run, so there is no out-of-memory trial on the device. It returns the
        largest micro-batch size whose step fits the budget and the `k` that
        reaches the target batch size. On a TPU or GPU the default budget is the
        device's free memory; the CPU reports none, so the notebook picks one.
        """
    ),
    code(
        """
        TARGET = 2**16 if FULL else 8192  # examples per optimizer update
        BUDGET = None if FULL else 24 * MiB  # None: the device's free memory

        step, state = accumulate_step(K)  # its memory does not depend on k
        plan = optax_accum.plan_micro_batch(
            step, params, state, example, TARGET, memory_budget=BUDGET
        )
        print(plan)
        print(
            f"budget {plan.memory_budget / MiB:,.1f} MiB: "
            f"micro-batches of {plan.micro_batch_size} "
            f"({plan.memory_bytes / MiB:,.1f} MiB), k = {plan.num_micro_batches}, "
            f"found with {plan.num_compilations} compilations"
        )
        if plan.next_micro_batch_size is not None:
            print(
                f"the next size up, {plan.next_micro_batch_size}, "
                f"needs {plan.next_memory_bytes / MiB:,.1f} MiB"
            )
        """
    ),
    md(
        """
        Check the plan against the measurement, and take one real update with it:
        """
    ),
    code(
        """
        measured = memory("accumulate", K, plan.micro_batch_size)["peak"]
        assert measured <= plan.memory_budget, (measured, plan.memory_budget)
        if plan.next_micro_batch_size is not None:
            above = memory("accumulate", K, plan.next_micro_batch_size)["peak"]
            assert above > plan.memory_budget, (above, plan.memory_budget)
        whole = memory("microbatch", 1, TARGET)["peak"]
        print(f"the full batch of {TARGET} would need {whole / MiB:,.1f} MiB")

        step, state = accumulate_step(plan.num_micro_batches)
        p = jax.tree.map(jnp.copy, params)  # the step donates its inputs
        for i in range(plan.num_micro_batches):
            k_x, k_y = jax.random.split(jax.random.key(i))
            batch = {
                "x": jax.random.normal(k_x, (plan.micro_batch_size, DIM)),
                "y": jax.random.randint(k_y, (plan.micro_batch_size,), 0, CLASSES),
            }
            p, state = step(p, state, batch)
        assert optax_accum.has_updated(state)
        print(
            f"one update of {plan.effective_batch_size} examples "
            f"in {plan.num_micro_batches} micro-steps"
        )
        """
    ),
]


# --------------------------------------------------------------------------
# 04: pod scale
# --------------------------------------------------------------------------

POD_SCALE = [
    *header(
        "04_pod_scale",
        "`microbatch` on a sharded mesh",
        """
        Data parallelism over all the devices of the runtime (the 8 cores of a
        Colab TPU v2-8; 8 simulated CPU devices on a CPU), with gradient accumulation inside
        one jitted step. `optax_accum.microbatch` splits the batch into `k`
        micro-batches without copying it, keeps every micro-batch spread over
        all devices, accumulates gradients device-locally in a `lax.scan` and
        all-reduces them **once**, after the loop, not once per micro-batch.

        This notebook shows the sharding, checks that the gradients equal the
        full-batch gradients, and counts the all-reduces in the compiled HLO.
        """,
    ),
    code(
        """
        import glob
        import os

        import jax  # importing JAX does not start its backends; using it does


        def accelerator_requested():
            # Decided from the environment: asking JAX (jax.devices()) would
            # initialise its backends, after which the device count is fixed.
            platforms = os.environ.get("JAX_PLATFORMS", "").lower()
            if platforms:
                return platforms.split(",")[0].strip() != "cpu"
            if any(
                os.environ.get(v)
                for v in ["COLAB_TPU_ADDR", "TPU_NAME", "TPU_ACCELERATOR_TYPE", "COLAB_GPU"]
            ):
                return True
            return bool(
                glob.glob("/dev/accel*")
                or glob.glob("/dev/vfio/[0-9]*")
                or glob.glob("/dev/nvidia[0-9]*")
            )


        if not accelerator_requested():
            # Must run before anything touches the backend (jax.devices(), any array).
            jax.config.update("jax_num_cpu_devices", 8)
        """
    ),
    DEVICES,
    md(
        """
        ## A mesh over all devices, and a sharded batch

        `jax.make_mesh` builds an *Explicit* mesh: shardings are part of the
        array types (`jax.typeof(x)` shows them), and `microbatch` reads them at
        trace time. The batch is sharded along its first axis over `"data"`;
        the parameters are replicated.
        """
    ),
    code(
        """
        import re

        import numpy as np
        import optax
        from jax import numpy as jnp
        from jax.sharding import PartitionSpec as P

        import optax_accum

        N = jax.device_count()
        K = 4  # micro-batches per step
        PER_DEVICE = 256 if FULL else 8  # rows of one micro-batch on one device
        BATCH = K * N * PER_DEVICE
        DIM, HIDDEN, CLASSES = (512, 2048, 1000) if FULL else (32, 128, 10)

        mesh = jax.make_mesh((N,), ("data",))
        jax.set_mesh(mesh)
        print(mesh)


        def loss_fn(params, batch):
            hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
            logits = hidden @ params["w2"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


        k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
        params = {
            "w1": jax.random.normal(k1, (DIM, HIDDEN)) / np.sqrt(DIM),
            "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) / np.sqrt(HIDDEN),
        }
        params = jax.device_put(params, P())  # replicated
        batch = {
            "x": jax.device_put(jax.random.normal(k3, (BATCH, DIM)), P("data")),
            "y": jax.device_put(jax.random.randint(k4, (BATCH,), 0, CLASSES), P("data")),
        }
        print(
            "x:",
            jax.typeof(batch["x"]),
            " y:",
            jax.typeof(batch["y"]),
            " w1:",
            jax.typeof(params["w1"]),
        )
        jax.debug.visualize_array_sharding(batch["x"])
        """
    ),
    md(
        """
        `microbatch` splits the batch with a free reshape, `(B, ...) -> (B/k, k, ...)`:
        micro-batch `i` holds rows `i, i + k, i + 2k, ...`. Each micro-batch is
        therefore still spread over every device, and no device ever sits idle
        or receives another device's rows:
        """
    ),
    code(
        """
        rows = jax.device_put(jnp.arange(BATCH), P("data"))  # each row's index in the batch
        micro_batches = rows.reshape(BATCH // K, K)
        print("micro-batch 0:", jax.typeof(micro_batches[:, 0]))
        for device in range(min(N, 3)):
            own = np.asarray(rows.addressable_shards[device].data)
            mine = np.asarray(micro_batches[:, 0].addressable_shards[device].data)
            assert set(mine) <= set(own)  # a device computes on its own rows only
            print(
                f"device {device} holds rows {own[0]}..{own[-1]}; "
                f"its part of micro-batch 0: {mine}"
            )
        print("...")
        """
    ),
    md(
        """
        ## The gradients equal the full-batch gradients
        """
    ),
    code(
        """
        full_batch = jax.jit(jax.value_and_grad(loss_fn))
        accumulated = jax.jit(optax_accum.microbatch(jax.value_and_grad(loss_fn), K))

        loss, grads = full_batch(params, batch)
        micro_loss, micro_grads = accumulated(params, batch)
        print(f"loss: full batch {float(loss):.6f}, {K} micro-batches {float(micro_loss):.6f}")
        np.testing.assert_allclose(micro_loss, loss, rtol=1e-5)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
            micro_grads,
            grads,
        )
        print("gradients:", {name: str(jax.typeof(g)) for name, g in micro_grads.items()})
        print(f"microbatch(k={K}) == full batch on {N} devices")
        """
    ),
    md(
        """
        ## Counting all-reduces in the compiled HLO

        An all-reduce inside the `while` loop's body runs once per micro-batch;
        one outside it runs once per step. Three ways to compute the same
        gradient:

        * the full batch: the compiler all-reduces the gradients once;
        * `microbatch` (the default, device-local loop): the same single
          all-reduce, after the loop, whatever `k`;
        * `microbatch(..., mesh_axes=None)`: the loop runs on whole, sharded
          micro-batches and the compiler reduces every micro-batch's gradients:
          `k` all-reduces per step, `k` times the traffic.
        """
    ),
    code(
        """
        # The opcode, not an instruction name such as %all-reduce.3 or an operand.
        ALL_REDUCE = re.compile(r"(?<![%\\w.-])all-reduce(?:-start)?\\(")


        def all_reduce_counts(fn, *args):
            # (outside any loop, inside a while body) from the optimised HLO.
            hlo = jax.jit(fn).lower(*args).compile().as_text()
            computations, name = {}, None
            for line in hlo.splitlines():
                if line and not line[0].isspace() and line.rstrip().endswith("{"):
                    name = line.removeprefix("ENTRY ").split()[0].lstrip("%")
                    computations[name] = []
                elif name is not None:
                    computations[name].append(line)
            bodies = set(re.findall(r"body=%?([\\w.\\-]+)", hlo))
            inside = outside = 0
            for name, lines in computations.items():
                count = sum(len(ALL_REDUCE.findall(line)) for line in lines)
                if name in bodies:
                    inside += count
                else:
                    outside += count
            return outside, inside


        variants = {
            "full batch": jax.value_and_grad(loss_fn),
            f"microbatch(k={K})": optax_accum.microbatch(jax.value_and_grad(loss_fn), K),
            f"microbatch(k={K}, mesh_axes=None)": optax_accum.microbatch(
                jax.value_and_grad(loss_fn), K, mesh_axes=None
            ),
        }
        per_step = {}
        print(f"{'':34} {'outside':>8} {'in loop':>8} {'per step':>9}")
        for name, fn in variants.items():
            outside, inside = all_reduce_counts(fn, params, batch)
            per_step[name] = outside + K * inside
            print(f"{name:34} {outside:8d} {inside:8d} {per_step[name]:9d}")
        """
    ),
    code(
        """
        ours = all_reduce_counts(
            optax_accum.microbatch(jax.value_and_grad(loss_fn), K), params, batch
        )
        assert ours[1] == 0, "microbatch must not all-reduce inside its loop"
        assert per_step[f"microbatch(k={K})"] <= per_step["full batch"]
        assert per_step[f"microbatch(k={K})"] <= per_step[f"microbatch(k={K}, mesh_axes=None)"]
        print(
            f"microbatch: {per_step[f'microbatch(k={K})']} all-reduce(s) per step, "
            "like the full batch"
        )
        """
    ),
    md(
        """
        ## A sharded training loop

        The micro-batched gradient goes straight into any optax optimizer. Ten
        steps, against the same ten steps on the full batch:
        """
    ),
    code(
        """
        tx = optax.adamw(1e-3)


        def make_step(grad_fn):
            @jax.jit
            def step(params, opt_state, batch):
                loss, grads = grad_fn(params, batch)
                updates, opt_state = tx.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            return step


        micro_step = make_step(optax_accum.microbatch(jax.value_and_grad(loss_fn), K))
        large_step = make_step(jax.value_and_grad(loss_fn))
        p_micro, s_micro = params, tx.init(params)
        p_large, s_large = params, tx.init(params)
        for i in range(10):
            keys = jax.random.split(jax.random.key(100 + i))
            batch = {
                "x": jax.device_put(jax.random.normal(keys[0], (BATCH, DIM)), P("data")),
                "y": jax.device_put(
                    jax.random.randint(keys[1], (BATCH,), 0, CLASSES), P("data")
                ),
            }
            p_micro, s_micro, loss_micro = micro_step(p_micro, s_micro, batch)
            p_large, s_large, loss_large = large_step(p_large, s_large, batch)
            print(
                f"step {i + 1:2d}: loss {float(loss_micro):.5f} (microbatch), "
                f"{float(loss_large):.5f} (full batch)"
            )
        a, b = jax.tree.leaves(p_micro), jax.tree.leaves(p_large)
        distance = np.sqrt(
            sum(np.sum((x - y) ** 2) for x, y in zip(a, b, strict=True))
            / sum(np.sum(y**2) for y in b)
        )
        assert distance < 1e-5, distance
        print(f"after 10 steps: relative parameter distance {distance:.1e}")
        print("sharding of the updated w1:", jax.typeof(p_micro["w1"]))
        """
    ),
]


NOTEBOOKS: dict[str, list[Cell]] = {
    "01_quickstart": QUICKSTART,
    "02_token_weighting": TOKEN_WEIGHTING,
    "03_memory": MEMORY,
    "04_pod_scale": POD_SCALE,
}


def build(name: str, cells: list[Cell]) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "accelerator": "TPU",
        "colab": {"name": f"{name}.ipynb", "provenance": []},
        "kernelspec": {
            "display_name": "Python 3",
            "language": "python",
            "name": "python3",
        },
        "language_info": {"name": "python"},
    }
    for i, (kind, source) in enumerate(cells):
        if kind == "markdown":
            cell = nbformat.v4.new_markdown_cell(source)
        else:
            cell = nbformat.v4.new_code_cell(source)
        cell.id = f"{name[:2]}-{i:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(name: str) -> str:
    return nbformat.writes(build(name, NOTEBOOKS[name])) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="only compare, write nothing"
    )
    args = parser.parse_args(argv)
    stale = []
    for name in NOTEBOOKS:
        path = HERE / f"{name}.ipynb"
        text = render(name)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(path.name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("stale, rerun notebooks/_build.py:", ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
