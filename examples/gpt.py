# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""A GPT-style decoder in Flax nnx: the reference model of the benchmarks.

One copy, shared by ``benchmarks/bench_transformer.py``, the notebook
``notebooks/05_memory_remat`` and ``tests/integration/test_gpt_example.py``.
A `GPTConfig` sizes it: token embedding plus learned positions, ``n_layers``
pre-LayerNorm blocks (causal multi-head attention, then a GELU MLP, each in a
residual branch), a final LayerNorm, and logits from the embedding matrix
itself (tied output).

Parameters are float32; the matrix products run in ``config.dtype`` (float32
or bfloat16), LayerNorm statistics, the softmax and the loss in float32.
``config.remat`` wraps every block in ``nnx.remat``: ``"none"`` keeps all
activations for the backward pass, ``"dots"`` saves only the outputs of the
matrix products without batch dimensions (the projections and the MLP, not
the attention scores) and recomputes the rest, ``"full"`` saves nothing but
each block's input and recomputes the block.

Not a package module: load it by path (``importlib`` or ``sys.path``), as the
benchmarks and tests do.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "none": None,  # not wrapped at all
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The size and numerics of a `GPT`.

    Attributes:
      vocab_size: number of token ids.
      d_model: width of the residual stream.
      n_layers: number of blocks.
      n_heads: attention heads; must divide ``d_model``.
      seq_len: longest sequence (the number of learned positions).
      mlp_ratio: MLP hidden width over ``d_model``.
      dtype: compute dtype, ``"float32"`` or ``"bfloat16"``.
      remat: ``"none"``, ``"dots"`` or ``"full"`` (see the module docstring).
    """

    vocab_size: int = 8192
    d_model: int = 384
    n_layers: int = 4
    n_heads: int = 6
    seq_len: int = 128
    mlp_ratio: int = 4
    dtype: str = "float32"
    remat: str = "none"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an int >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"`n_heads`={self.n_heads} must divide `d_model`={self.d_model}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(
                f"`dtype` must be one of {list(DTYPES)}, got {self.dtype!r}"
            )
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"`remat` must be one of {list(REMAT_POLICIES)}, got {self.remat!r}"
            )

    @property
    def compute_dtype(self) -> Any:
        return DTYPES[self.dtype]

    def replace(self, **changes: Any) -> GPTConfig:
        return dataclasses.replace(self, **changes)


PRESETS = {
    # About 10.3M parameters: what a 2-core CPU trains (and compiles) in a
    # benchmark; 4 layers keep XLA's compile times short.
    "cpu_small": GPTConfig(),
    # GPT-2 small: 124M parameters (with its 50257-token vocabulary).
    "gpt2_small": GPTConfig(
        vocab_size=50257, d_model=768, n_layers=12, n_heads=12, seq_len=1024
    ),
    # For the tests and --quick runs: a few hundred thousand parameters.
    "tiny": GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, seq_len=32),
}


def preset(name: str, **changes: Any) -> GPTConfig:
    """A preset of `PRESETS` (``cpu_small``, ``gpt2_small``, ``tiny``), changed."""
    if name not in PRESETS:
        raise ValueError(f"`name` must be one of {list(PRESETS)}, got {name!r}")
    return PRESETS[name].replace(**changes)


class Block(nnx.Module):
    """Pre-LN block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        d, dtype = cfg.d_model, cfg.compute_dtype
        self.n_heads = cfg.n_heads
        self.ln1 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, dtype=dtype, rngs=rngs)
        # GPT-2's scaled init of the projections into the residual stream.
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layers))
        self.proj = nnx.Linear(d, d, dtype=dtype, kernel_init=out_init, rngs=rngs)
        self.ln2 = nnx.LayerNorm(d, dtype=dtype, rngs=rngs)
        hidden = cfg.mlp_ratio * d
        self.fc = nnx.Linear(d, hidden, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(hidden, d, dtype=dtype, kernel_init=out_init, rngs=rngs)

    def attention(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.n_heads
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * h, d // h), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // h)
        causal = jnp.tril(jnp.ones((t, t), bool))
        scores = jnp.where(causal, scores.astype(jnp.float32), -1e30)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
        return self.proj(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d))

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.attention(self.ln1(x))
        return x + self.out(jax.nn.gelu(self.fc(self.ln2(x))))


def _call_block(block: Block, x: jax.Array) -> jax.Array:
    return block(x)


class GPT(nnx.Module):
    """The decoder: ``GPT(cfg, rngs=nnx.Rngs(0))(tokens) -> float32 logits``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype = cfg.compute_dtype
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Embed(
            cfg.vocab_size, cfg.d_model, dtype=dtype, embedding_init=init, rngs=rngs
        )
        self.pos = nnx.Param(init(rngs.params(), (cfg.seq_len, cfg.d_model)))
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, dtype=dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = tokens.shape[-1]
        if t > self.cfg.seq_len:
            raise ValueError(
                f"`tokens` has {t} positions, more than `seq_len`={self.cfg.seq_len}"
            )
        x = self.embed(tokens) + self.pos[:t].astype(self.cfg.compute_dtype)
        policy = REMAT_POLICIES[self.cfg.remat]
        call = _call_block
        if self.cfg.remat != "none":
            call = nnx.remat(_call_block, policy=policy)
        for block in self.blocks:
            x = call(block, x)
        # Tied output: logits against the embedding matrix, in float32.
        return self.embed.attend(self.ln_f(x)).astype(jnp.float32)


def loss_fn(model: GPT, batch: dict[str, jax.Array]) -> jax.Array:
    """Token-mean next-token cross-entropy over ``batch["mask"]``.

    ``batch``: ``inputs`` and ``targets`` (int32, ``[B, T]``) and ``mask``
    (float32, ``[B, T]``, 1 for a counted token). With no counted token the
    loss is 0. Weight micro-batches by ``mask.sum()`` for the exact token mean
    of a whole batch.
    """
    logits = model(batch["inputs"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    mask = batch["mask"].astype(jnp.float32)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def token_count(batch: dict[str, jax.Array]) -> jax.Array:
    """The weight of a (micro-)batch: its number of counted tokens."""
    return jnp.sum(batch["mask"].astype(jnp.float32))


def make_loss(cfg: GPTConfig) -> Callable[[Any, dict[str, jax.Array]], jax.Array]:
    """``loss(params, batch)``: `loss_fn` of a `GPT` as a pure function.

    ``params`` is the ``nnx.State`` of the model's ``nnx.Param`` variables (a
    pytree of float32 arrays), e.g. from `init_params`; its structure does not
    depend on ``dtype`` or ``remat``, so one set of parameters serves every
    variant. Nothing is initialised here (the graph comes from
    ``nnx.eval_shape``).
    """
    abstract = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract, nnx.Param)

    def loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
        return loss_fn(nnx.merge(graphdef, params), batch)

    return loss


def init_params(cfg: GPTConfig, seed: int = 0) -> Any:
    """The float32 parameters (an ``nnx.State``) of ``GPT(cfg)``, compiled."""

    @jax.jit
    def init(key):
        return nnx.state(GPT(cfg, rngs=nnx.Rngs(key)), nnx.Param)

    return init(jax.random.key(seed))


def functional(
    cfg: GPTConfig, seed: int = 0
) -> tuple[Any, Callable[[Any, dict[str, jax.Array]], jax.Array]]:
    """``(init_params(cfg, seed), make_loss(cfg))``."""
    return init_params(cfg, seed), make_loss(cfg)


def example(cfg: GPTConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """One example (no batch axis), as `optax_accum.plan_microbatch` wants."""
    t = cfg.seq_len
    return {
        "inputs": jax.ShapeDtypeStruct((t,), jnp.int32),
        "targets": jax.ShapeDtypeStruct((t,), jnp.int32),
        "mask": jax.ShapeDtypeStruct((t,), jnp.float32),
    }


def random_batch(
    key: jax.Array, cfg: GPTConfig, batch_size: int, *, pad_fraction: float = 0.0
) -> dict[str, jax.Array]:
    """Random tokens; the last ``pad_fraction`` of each row's length, at random."""
    k_tok, k_len = jax.random.split(key)
    tokens = jax.random.randint(
        k_tok, (batch_size, cfg.seq_len + 1), 0, cfg.vocab_size, jnp.int32
    )
    mask = jnp.ones((batch_size, cfg.seq_len), jnp.float32)
    if pad_fraction > 0:
        low = max(1, round(cfg.seq_len * (1 - pad_fraction)))
        lengths = jax.random.randint(k_len, (batch_size, 1), low, cfg.seq_len + 1)
        mask = (jnp.arange(cfg.seq_len) < lengths).astype(jnp.float32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def num_params(params: Any) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
