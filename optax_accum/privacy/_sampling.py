# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Poisson sampling of logical batches, padded to a fixed number of micro-batches.

DP-SGD's privacy amplification by sampling assumes that every example joins
each logical batch independently with probability ``q``, so the batch's size
varies from step to step. A compiled step wants one shape: this module pads
each batch to whole micro-batches and then to a fixed number of them, with a
mask that marks the padding rows. Batch ``t`` is a function of ``(seed, t)``
alone, so a run resumes at any step without replaying the ones before it.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _checks

# The default cap leaves a batch of Poisson sampling above it with probability
# at most this, per step (a proven bound, below); see `overflow`.
_DEFAULT_OVERFLOW_BOUND = 1e-12
PADDING_INDEX = -1  # jax_privacy's padding index (`split_and_pad_global_batch`)


def sampling_rate_check(value: Any, name: str = "sampling_rate") -> float:
    """``value`` as a float in (0, 1], or an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number in (0, 1], got {value!r}.")
    value = float(value)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"`{name}` must be in (0, 1], got {value!r}.")
    return value


def nonnegative_int(value: Any, name: str) -> int:
    """``value`` as an int >= 0, or an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an integer, got {value!r}.")
    if value < 0:
        raise ValueError(f"`{name}` must be >= 0, got {value}.")
    return int(value)


def binomial_tail_bound(n: int, p: float, cap: int) -> float:
    """An upper bound on ``P(Binomial(n, p) > cap)`` (Bernstein's inequality).

    .. math::
        P(X - \\mu \\ge t) \\le \\exp\\left(-\\frac{t^2}{2 (\\sigma^2 + t / 3)}\\right),
        \\quad \\mu = np,\\ \\sigma^2 = np(1 - p).
    """
    if cap >= n:
        return 0.0
    t = cap + 1 - n * p  # X > cap means X >= cap + 1
    if t <= 0:
        return 1.0
    return min(1.0, math.exp(-(t * t) / (2.0 * (n * p * (1.0 - p) + t / 3.0))))


def binomial_tail(n: int, p: float, cap: int) -> float:
    """``P(Binomial(n, p) > cap)``, summed term by term (in logs) from
    ``cap + 1`` until the terms stop counting."""
    if cap >= n:
        return 0.0
    if p >= 1.0:
        return 1.0
    log_p, log_q = math.log(p), math.log1p(-p)
    total, k = 0.0, cap + 1
    while k <= n:
        log_term = (
            math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
            + k * log_p + (n - k) * log_q
        )  # fmt: skip
        term = math.exp(log_term)
        total += term
        if k > n * p and term < 1e-17 * total:
            break
        k += 1
    return min(1.0, total)


def _bernstein_cap(n: int, p: float, bound: float) -> int:
    """The smallest ``cap`` that `binomial_tail_bound` proves below ``bound``."""
    log_inv = math.log(1.0 / bound)
    var = n * p * (1.0 - p)
    t = log_inv / 3.0 + math.sqrt((log_inv / 3.0) ** 2 + 2.0 * log_inv * var)
    cap = min(n, max(0, math.ceil(n * p + t) - 1))
    while cap < n and binomial_tail_bound(n, p, cap) > bound:  # rounding
        cap += 1
    return cap


class PoissonBatch(NamedTuple):
    """One logical batch of Poisson sampling, as whole micro-batches.

    Attributes:
      step: the batch's index ``t``; the batch is a function of the seed and
        ``t`` alone.
      indices: ``int32[num_microbatches, microbatch_size]``, example indices;
        row ``j`` is micro-batch ``j``. The real examples come first, in
        increasing order; `fused_rows` gives the flat order of a fused step
        (``num_microbatches=``). The padding rows hold ``-1`` (as in jax_privacy's
        `split_and_pad_global_batch`), which NumPy and JAX read as the last
        example: gather the rows with `take`, which reads no example for them.
      mask: ``bool[num_microbatches, microbatch_size]``, True for the real
        examples.
      size: the number of real examples (after truncation, if any).
      truncated: whether the Poisson draw exceeded the cap and was truncated
        to it (only with ``overflow="truncate"``).
    """

    step: int
    indices: np.ndarray
    mask: np.ndarray
    size: int
    truncated: bool

    @property
    def num_real_microbatches(self) -> int:
        """The micro-batches that hold at least one real example (they come
        first); the rest are all padding, and a loop may skip them."""
        return -(-self.size // self.indices.shape[1])

    @property
    def num_calls(self) -> int:
        """The micro-batches a per-call loop feeds `dp_accumulate`, closing
        the window (``close_window=True``) on the last: the real ones, and
        one all-padding micro-batch when the batch is empty.

        An empty batch must still close a window, so that it draws its noise:
        a loop over the real micro-batches only makes no call, leaves the
        parameters exactly unchanged (which reveals the empty batch) and
        parts from the fused step (issue 39). The all-padding micro-batch's
        clipped sum is exactly zero, and computing it costs nothing.
        """
        return max(1, self.num_real_microbatches)

    def fused_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """``(indices, mask)`` as one flat batch of rows, in the order the fused
        loop splits it.

        `clipped_value_and_grad` with ``num_microbatches=k`` (and
        `microbatch`) takes micro-batch ``i`` as rows ``i, i + k, ...``, so
        row ``r`` of micro-batch ``i`` goes to position ``r * k + i``: then
        the loop's micro-batch ``i`` is ``indices[i]``, and the all-padding
        micro-batches, which the loop skips, stay all padding.
        """
        return self.indices.T.reshape(-1), self.mask.T.reshape(-1)

    def take(self, *arrays: Any, fused: bool = True) -> tuple:
        """The batch's rows of each of ``arrays``, padding rows as zeros, and
        the mask.

        Indexing with `indices` reads example ``N - 1`` for every padding row
        (``-1``), so an example that was not sampled would reach the sum
        wherever the mask is not applied (issue 39). Here a padding row reads
        no example: it is zeros, whatever the data set holds.

        Pass the mask to `clipped_value_and_grad` (``example_mask_fn``) as
        well: a zero row has a gradient of its own (a bias's, say), and only
        the mask makes it contribute exactly zero, so that adding or removing
        an example moves the sum by at most ``C``.

        Args:
          *arrays: NumPy or JAX arrays (or pytrees of them) of ``N`` rows
            along their leading axis, e.g. the inputs and the labels.
          fused: the rows in `fused_rows`' order, one flat batch (for
            ``num_microbatches=``); False: shaped ``(num_microbatches,
            microbatch_size, ...)``, micro-batch ``j`` at ``[j]``.

        Returns:
          ``(*rows, mask)``: one gathered array (or pytree) per argument and
          the matching boolean mask, True for the real examples.

        Examples:
          >>> import numpy as np
          >>> from optax_accum import privacy
          >>> batch = privacy.PoissonBatch(
          ...     0, np.array([[1, 3], [-1, -1]], np.int32),
          ...     np.array([[True, True], [False, False]]), 2, False)
          >>> x = np.arange(1.0, 5.0)  # 4 examples: 1, 2, 3, 4
          >>> rows, mask = batch.take(x, fused=False)
          >>> rows.tolist(), mask.tolist()  # no 4.0 (example -1) in the padding
          ([[2.0, 4.0], [0.0, 0.0]], [[True, True], [False, False]])
        """
        if fused:
            indices, mask = self.fused_rows()
        else:
            indices, mask = self.indices, self.mask
        safe = np.where(mask, indices, 0)

        def gather(a):
            xp = np if isinstance(a, np.ndarray | np.generic) else jnp
            rows = a[safe]
            keep = mask.reshape(mask.shape + (1,) * (rows.ndim - mask.ndim))
            return xp.where(keep, rows, xp.zeros_like(rows))

        return (*(jax.tree.map(gather, a) for a in arrays), mask)


class PoissonMicrobatches:
    """The logical batches of `poisson_microbatches`: iterable, resumable.

    Iterating yields the batches ``start, start + 1, ...`` (``steps`` of them,
    or without end); `batch` gives any one of them. See `poisson_microbatches`
    for the arguments.
    """

    def __init__(
        self,
        num_examples: Any,
        sampling_rate: Any,
        microbatch_size: Any,
        *,
        seed: Any,
        max_microbatches: Any = None,
        overflow: str = "truncate",
        steps: Any = None,
        start: Any = 0,
    ):
        self.num_examples = _checks.positive_int(num_examples, "num_examples")
        self.sampling_rate = sampling_rate_check(sampling_rate)
        self.microbatch_size = _checks.positive_int(microbatch_size, "microbatch_size")
        self.seed = nonnegative_int(seed, "seed")
        self.overflow = _checks.one_of(overflow, "overflow", ("truncate", "raise"))
        self.steps = None if steps is None else nonnegative_int(steps, "steps")
        self.start = nonnegative_int(start, "start")
        m = self.microbatch_size
        if max_microbatches is None:
            # The bound at N + 1: under add-or-remove adjacency the neighbouring
            # data set may hold one example more.
            cap = _bernstein_cap(
                self.num_examples + 1, self.sampling_rate, _DEFAULT_OVERFLOW_BOUND
            )
            self.num_microbatches = max(1, -(-cap // m))
        else:
            self.num_microbatches = _checks.positive_int(
                max_microbatches, "max_microbatches"
            )
        # The truncation threshold is the padded shape's capacity (above N it
        # is never reached on this data set, but may be on its neighbour's).
        self.max_batch_size = self.num_microbatches * m
        self._warned = False  # truncation warns once per sampler

    @property
    def expected_batch_size(self) -> float:
        """``q · N``: what the summed, noised gradients are divided by. Never
        the realised size, which depends on the data set and is private."""
        return self.sampling_rate * self.num_examples

    @property
    def overflow_probability(self) -> float:
        """An upper bound on the probability that one step's Poisson draw
        exceeds `max_batch_size` (``num_microbatches * microbatch_size``), for
        a data set of ``num_examples + 1``: the neighbour that add-or-remove
        adjacency compares with."""
        return binomial_tail_bound(
            self.num_examples + 1, self.sampling_rate, self.max_batch_size
        )

    def batch(self, step: Any) -> PoissonBatch:
        """Logical batch ``step``, drawn from its own stream ``(seed, step)``."""
        step = nonnegative_int(step, "step")
        rng = np.random.default_rng(
            np.random.SeedSequence(self.seed, spawn_key=(step,))
        )
        n, cap = self.num_examples, self.max_batch_size
        # Lemma 1 of arXiv:2406.17298 (as jax_privacy's CyclicPoissonSampling):
        # a Binomial(N, q) size, then a uniform subset of it, is Poisson sampling.
        size = int(rng.binomial(n, self.sampling_rate))
        truncated = size > cap
        if truncated and self.overflow == "raise":
            raise ValueError(
                f"Logical batch {step} drew {size} examples, more than the "
                f"{cap} of `max_microbatches={self.num_microbatches}` micro-batches "
                f"of {self.microbatch_size}; raise `max_microbatches`, or pass "
                '`overflow="truncate"` and account for the truncation.'
            )
        if truncated and not self._warned:
            self._warned = True
            self._warn_truncation(step, size)
        # Truncation keeps a uniform subset of the draw: the same distribution
        # as a uniform subset of size `cap` of the whole data set.
        size = min(size, cap)
        chosen = np.sort(rng.choice(n, size=size, replace=False))
        flat = np.full(self.num_microbatches * self.microbatch_size, PADDING_INDEX)
        flat[:size] = chosen
        indices = flat.astype(np.int32).reshape(self.num_microbatches, -1)
        return PoissonBatch(step, indices, indices >= 0, size, truncated)

    def _warn_truncation(self, step: int, size: int) -> None:
        """Truncation is another mechanism: say so, with what it costs."""
        n, cap = self.num_examples, self.max_batch_size
        p = binomial_tail(n, self.sampling_rate, cap)
        warnings.warn(
            f"Logical batch {step} drew {size} examples and was truncated to "
            f"the cap of {cap} (`max_microbatches={self.num_microbatches}` "
            f"micro-batches of {self.microbatch_size}); a batch is truncated "
            f"with probability {p:.3g} ({100 * p:.3g}%) per step. Truncated "
            "Poisson sampling spends more privacy than Poisson sampling: "
            "account for it with epsilon(..., accountant='pld', "
            f"truncated_batch_size={cap}, num_examples={n}), raise "
            '`max_microbatches`, or pass overflow="raise". This warning is '
            "given once per sampler.",
            UserWarning,
            stacklevel=3,
        )

    def __iter__(self) -> Iterator[PoissonBatch]:
        step = self.start
        while self.steps is None or step < self.start + self.steps:
            yield self.batch(step)
            step += 1

    def __repr__(self) -> str:
        return (
            f"poisson_microbatches(num_examples={self.num_examples}, "
            f"sampling_rate={self.sampling_rate}, "
            f"microbatch_size={self.microbatch_size}, seed={self.seed}, "
            f"max_microbatches={self.num_microbatches}, overflow={self.overflow!r}, "
            f"steps={self.steps}, start={self.start})"
        )


def poisson_microbatches(
    num_examples: int,
    sampling_rate: float,
    microbatch_size: int,
    *,
    seed: int,
    max_microbatches: int | None = None,
    overflow: str = "truncate",
    steps: int | None = None,
    start: int = 0,
) -> PoissonMicrobatches:
    """The logical batches of Poisson sampling, padded to whole micro-batches.

    Each logical batch includes every example independently with probability
    ``q = sampling_rate``: the sampling that privacy amplification by
    subsampling (and so `epsilon`) assumes. Its realised size varies; each
    batch comes as ``indices`` and ``mask`` of one fixed shape,
    ``(max_microbatches, microbatch_size)``, so a jitted step compiles once.

    Normalise the noised sum by `PoissonMicrobatches.expected_batch_size`
    (``q · N``), never by the batch's ``size``: the realised size depends on
    whether one example is in the data set, and dividing by it spends privacy
    that no accountant counts.

    **The cap.** By default ``max_microbatches`` covers ``P(size > cap) ≤
    1e-12`` per step (Bernstein's bound, for a data set of ``N + 1``:
    `PoissonMicrobatches.overflow_probability`); the default is computed
    from ``num_examples``, so where ``N`` itself is private, pass a public
    ``max_microbatches``. A draw above the cap is:

    - ``overflow="truncate"`` (default): cut to a uniform random subset of
      ``cap`` examples, as jax_privacy's ``truncated_batch_size`` does, with
      a ``UserWarning`` at the first truncated batch (once per sampler) that
      gives the probability of a truncation per step. The batches are then
      *truncated* Poisson sampling. ``epsilon(...,
      truncated_batch_size=sampler.max_batch_size, num_examples=N,
      accountant="pld")`` accounts for it exactly; or, with ``p =
      overflow_probability`` and ``T`` steps, the untruncated ``(ε, δ)`` holds
      as ``(ε, δ + (1 + e^ε) · T · p)`` (the truncated and untruncated runs
      couple except on an overflow).
    - ``overflow="raise"``: a ValueError at that step, so that every batch
      trained on is exact Poisson sampling (raise the cap and resume).

    Splitting an overflow into a second call is not offered: the fused DP step
    has a fixed number of micro-batches.

    Args:
      num_examples: ``N``, the size of the data set (>= 1).
      sampling_rate: ``q`` in (0, 1].
      microbatch_size: the rows of one micro-batch (>= 1).
      seed: an integer >= 0. Batch ``t`` is drawn from the NumPy stream
        ``SeedSequence(seed, spawn_key=(t,))``: the same seed gives the same
        batches, on any machine, and batch ``t`` does not depend on the others.
      max_microbatches: the fixed number of micro-batches of every batch;
        ``None`` for the default cap above.
      overflow: ``"truncate"`` or ``"raise"``, above.
      steps: how many batches iterating yields; ``None`` for no end.
      start: the first step that iterating yields: resume a run at ``start =
        the steps already taken``.

    Returns:
      A `PoissonMicrobatches`: iterate it for its `PoissonBatch` values, or read one
      with ``.batch(t)``; ``.num_microbatches``, ``.max_batch_size``,
      ``.expected_batch_size`` and ``.overflow_probability`` describe it.

    Raises:
      TypeError, ValueError: for an argument out of range, naming it.

    Examples:
      >>> from optax_accum import privacy
      >>> sampler = privacy.poisson_microbatches(1000, 0.1, 16, seed=0, steps=2)
      >>> sampler.expected_batch_size, sampler.num_microbatches
      (100.0, 12)
      >>> for batch in sampler:
      ...     print(batch.indices.shape, batch.size == batch.mask.sum())
      (12, 16) True
      (12, 16) True
    """
    return PoissonMicrobatches(
        num_examples,
        sampling_rate,
        microbatch_size,
        seed=seed,
        max_microbatches=max_microbatches,
        overflow=overflow,
        steps=steps,
        start=start,
    )


def pad_microbatches(
    indices: Any, microbatch_size: int, num_microbatches: int
) -> tuple[np.ndarray, np.ndarray]:
    """Any batch of example indices as fixed-shape micro-batches and a mask.

    For batches from another sampler (jax_privacy's
    ``batch_selection.CyclicPoissonSampling``, ``BallsInBinsSampling``, ...):
    the indices fill ``num_microbatches`` micro-batches in order, the rest is
    padding (``-1``, mask False).

    Args:
      indices: a 1-D array of example indices (>= 0).
      microbatch_size: the rows of one micro-batch (>= 1).
      num_microbatches: the fixed number of micro-batches (>= 1).

    Returns:
      ``(indices, mask)``, ``int32`` and ``bool``, both of shape
      ``(num_microbatches, microbatch_size)``.

    Raises:
      ValueError: if ``indices`` is not 1-D, holds a negative index, or does
        not fit.

    Examples:
      >>> from optax_accum import privacy
      >>> idx, mask = privacy.pad_microbatches(np.array([4, 2, 7]), 2, 3)
      >>> idx.tolist(), mask.sum().item()
      ([[4, 2], [7, -1], [-1, -1]], 3)
    """
    m = _checks.positive_int(microbatch_size, "microbatch_size")
    k = _checks.positive_int(num_microbatches, "num_microbatches")
    indices = np.asarray(indices)
    if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
        raise ValueError(
            f"`indices` must be a 1-D integer array, got {indices.dtype} of "
            f"shape {indices.shape}."
        )
    if indices.size and indices.min() < 0:
        raise ValueError(f"`indices` must be >= 0, got {indices.min()}.")
    if indices.size > k * m:
        raise ValueError(
            f"`indices` holds {indices.size} examples, more than "
            f"`num_microbatches={k}` micro-batches of `microbatch_size={m}`."
        )
    flat = np.full(k * m, PADDING_INDEX, np.int32)
    flat[: indices.size] = indices
    padded = flat.reshape(k, m)
    return padded, padded >= 0
