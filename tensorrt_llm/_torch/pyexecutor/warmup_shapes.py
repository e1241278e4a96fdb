"""Which steps the warm-up runs: every shape class a scheduled step can have, once.

A step is `StepShape(num_context_tokens, num_contexts, num_generations)`: its context chunks'
tokens, how many chunks, and its generation rows (one token each). The scheduler can produce any
shape with `num_context_tokens + num_generations <= max_num_tokens`, `num_contexts +
num_generations <= max_batch_size` and `num_contexts <= num_context_tokens`, with enough chunks
for the context tokens when one request's chunk is bounded (`max_chunk_tokens`: max_seq_len).

What makes a kernel compile or autotune again is a size class, not a size:
- Triton specializes integer arguments that equal 1 or are multiples of 16 (our kernels pass row
  counts as `do_not_specialize`; fla's do not always);
- tile choices switch at power-of-two row counts (fp8 GEMM tiles, the MoE's block_m, PDL);
- fla's autotune keys are bucketed to powers of two (`triton_autotune.BucketedConfigCache`).
So `size_class(n) = (next power of two >= n, n % 16 == 0)`. Each kernel sees one dimension: the
linears, norms and MoE see all tokens, prefill attention and fla's chunk kernels the context
tokens, decode attention and the recurrent step the generation rows. A step's `features` are
those classes, tagged with the path the step runs on (decode graph replay, piecewise graphs,
eager), and the warm-up runs a set of steps whose features cover those of every possible step.
A chunk that continues a request (`carried`) is one more feature per path: fla's chunk kernels
take its initial state as a separately compiled variant, on no size of its own (fla never
specializes T). NOTE: the number of context chunks is not a feature: no kernel specializes on
it (it sizes a grid or a tensor, and fla's chunk index table is a tensor).
Steps whose chunks all continue their requests and are short (`rows`: MTP verify rows, the last
chunks after prefix hits) run the in-place recurrence of `gated_delta_net_rows.py` instead:
one more feature per path (hybrid models only: `StepLimits.recurrent_rows`), unsized, since the
kernel takes no row count; its one variant switch is PDL, on for grids up to a bound (few
rows), which the first and the last candidate (one row, the most rows) both reach.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from ..modules.gated_delta_net_rows import RECURRENT_ROWS_MAX_TOKENS

SizeClass = tuple[int, bool]
Feature = tuple[str, str, SizeClass]
_ANY_SIZE: SizeClass = (0, False)


def size_class(n: int) -> SizeClass:
    """(next power of two >= n, n % 16 == 0) for n >= 1."""
    if n < 1:
        raise ValueError(f"size_class needs n >= 1, got {n}")
    return 1 << (n - 1).bit_length(), n % 16 == 0


@dataclass(frozen=True)
class StepShape:
    num_context_tokens: int
    num_contexts: int
    num_generations: int
    # A context chunk starts after tokens already cached (an earlier chunk, a prefix hit):
    # fla's chunk kernels then take an initial state, a separate compiled variant.
    carried: bool = False
    # Every chunk continues its request and none is longer than RECURRENT_ROWS_MAX_TOKENS
    # (with `carried`): the Gated DeltaNet runs them token by token in place.
    rows: bool = False

    @property
    def num_tokens(self) -> int:
        return self.num_context_tokens + self.num_generations


@dataclass(frozen=True)
class StepLimits:
    """What bounds a step, and which steps replay graphs (from the started engine)."""

    max_num_tokens: int
    max_batch_size: int
    decode_graph_sizes: tuple[int, ...] = ()
    decode_graph_padding: bool = True
    piecewise_max_tokens: int = 0  # 0: no piecewise graphs
    max_chunk_tokens: int = 0  # the longest one request's chunk can be (0: max_num_tokens)
    # A hybrid model: its Gated DeltaNet runs `rows` steps through their own kernel.
    recurrent_rows: bool = False

    def __post_init__(self) -> None:
        if self.max_num_tokens < 1 or self.max_batch_size < 1 or self.max_chunk_tokens < 0:
            raise ValueError(
                f"max_num_tokens={self.max_num_tokens}, max_batch_size={self.max_batch_size} "
                f"and max_chunk_tokens={self.max_chunk_tokens} must be >= 1 (0: no chunk bound)"
            )

    def min_contexts(self, num_context_tokens: int) -> int:
        """How few requests' chunks can hold `num_context_tokens` (short max_seq_len)."""
        longest = self.max_chunk_tokens or self.max_num_tokens
        return -(-num_context_tokens // longest)

    def replays_decode_graph(self, num_generations: int) -> bool:
        sizes = sorted(self.decode_graph_sizes)
        if not self.decode_graph_padding:
            return num_generations in sizes
        i = bisect.bisect_left(sizes, num_generations)
        return i < len(sizes)

    def path(self, shape: StepShape) -> str:
        if shape.num_contexts == 0:
            return "graph" if self.replays_decode_graph(shape.num_generations) else "eager"
        return "piecewise" if shape.num_tokens <= self.piecewise_max_tokens else "eager"

    def is_possible(self, shape: StepShape) -> bool:
        return (
            shape.num_tokens >= 1
            and shape.num_tokens <= self.max_num_tokens
            and shape.num_contexts + shape.num_generations <= self.max_batch_size
            and shape.num_contexts <= shape.num_context_tokens
            and shape.num_contexts >= self.min_contexts(shape.num_context_tokens)
            and (shape.num_contexts > 0) == (shape.num_context_tokens > 0)
            and (shape.num_contexts > 0 or not shape.carried)
            and (
                not shape.rows
                or shape.carried
                and shape.num_context_tokens <= shape.num_contexts * RECURRENT_ROWS_MAX_TOKENS
            )
        )


def features(limits: StepLimits, shape: StepShape) -> frozenset[Feature]:
    """The size classes the step's kernels see, tagged with its path (none for a graph
    replay: its kernels compiled at capture and launch nothing new)."""
    path = limits.path(shape)
    if path == "graph":
        return frozenset()
    out: set[Feature] = {(path, "tokens", size_class(shape.num_tokens))}
    if shape.num_context_tokens:
        out.add((path, "context", size_class(shape.num_context_tokens)))
    if shape.num_generations:
        kind = "mixed" if shape.num_contexts else "decode"
        out.add((path, kind, size_class(shape.num_generations)))
    if shape.carried:  # one variant per path: nothing specializes it on a size
        out.add((path, "carried", _ANY_SIZE))
    if shape.rows and limits.recurrent_rows:  # one per path: the extremes are run (below)
        out.add((path, "rows", _ANY_SIZE))
    return frozenset(out)


def _candidates(limits: StepLimits) -> list[StepShape]:
    """Families of steps, linear in the limits, that together show every feature a possible
    step can have: one-chunk prefills; pure decodes; a 1-token chunk plus generation rows; one
    chunk plus one generation row; chunks plus rows that just leave the piecewise graphs (the
    only way a short chunk runs eagerly); a carried chunk on each path; and for every n, n
    carried one-token chunks (`rows`) and n carried chunks that run eagerly."""
    tokens, batch, pw = limits.max_num_tokens, limits.max_batch_size, limits.piecewise_max_tokens

    def step(ctx: int, gen: int) -> StepShape:  # as few chunks as the context needs
        return StepShape(ctx, limits.min_contexts(ctx), gen)

    out = [step(n, 0) for n in range(1, tokens + 1)]
    out += [step(0, g) for g in range(1, min(batch, tokens) + 1)]
    out += [step(1, g) for g in range(1, min(batch - 1, tokens - 1) + 1)]
    if batch >= 2:
        out += [step(n, 1) for n in range(1, tokens)]
    if pw:
        out += [step(pw + 1 - g, g) for g in range(1, min(batch - 1, pw) + 1)]
    out += [StepShape(n, limits.min_contexts(n), 0, carried=True) for n in (1, pw + 1)]
    if limits.recurrent_rows:
        # A lone short carried chunk runs as `rows` on a hybrid model; with a fresh chunk
        # after it (the dummies carry the first), the chunked rule's carried variant runs.
        out.append(StepShape(2, 2, 0, carried=True))
        counts = range(1, min(batch, tokens) + 1)
        out += [StepShape(n, n, 0, carried=True, rows=True) for n in counts]
        out += [_eager_rows(limits, n) for n in counts]
    return [s for s in out if limits.is_possible(s)]


def _eager_rows(limits: StepLimits, n: int) -> StepShape:
    """n carried chunks as long as a `rows` chunk can be, plus generation rows until the step
    leaves the piecewise graphs where the bounds allow (else a step the caller drops)."""
    per_row = min(RECURRENT_ROWS_MAX_TOKENS, limits.max_chunk_tokens or limits.max_num_tokens)
    ctx = min(n * per_row, limits.max_num_tokens)
    room = min(limits.max_batch_size - n, limits.max_num_tokens - ctx)
    gen = max(0, min(room, limits.piecewise_max_tokens + 1 - ctx))
    return StepShape(ctx, n, gen, carried=True, rows=True)


def warmup_steps(limits: StepLimits) -> list[StepShape]:
    """Steps whose features cover every possible step's: for each feature, the first and the
    last candidate that has it (the extremes of a class straddle any threshold inside it);
    sorted smallest first. `rows` candidates (each costs the warm-up a second step, for their
    chunks' first tokens) stand only for the features no other candidate has."""
    first: dict[Feature, StepShape] = {}
    last: dict[Feature, StepShape] = {}
    candidates = _candidates(limits)
    plain = {f for shape in candidates if not shape.rows for f in features(limits, shape)}
    for shape in candidates:
        for feature in features(limits, shape):
            if shape.rows and feature in plain:
                continue
            first.setdefault(feature, shape)
            last[feature] = shape
    steps = set(first.values()) | set(last.values())
    return sorted(steps, key=lambda s: (s.num_tokens, s.num_generations, s.num_context_tokens))


def covered_features(limits: StepLimits, steps: list[StepShape]) -> frozenset[Feature]:
    out: set[Feature] = set()
    for shape in steps:
        out |= features(limits, shape)
    return frozenset(out)
