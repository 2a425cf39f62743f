"""attngen's IR: a small, typed, immutable description of an attention program.

A `Program` is a tuple of `KernelIR`s (one for a plain forward; more once split-KV or the backward add
theirs). A kernel's body is a tree of statements over *buffers*: tensors in HBM (the kernel's
parameters, or scratch the naive algorithm needs) and values in registers (tiles, row statistics,
scalars). Sizes, loop bounds and indices are sympy expressions (see sym.py); tile arithmetic is a
small expression tree (`Call` of an `Op`). Every node is a frozen, slotted dataclass with tuple
children, so structural equality and hashing come for free and passes must build new trees.

`format_program` prints the text form that `attngen explain` shows after each pass.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields, replace
from typing import Iterator, Union

import sympy

from . import sym


class Space(enum.Enum):
    HBM = "hbm"
    REG = "reg"


class Role(enum.Enum):
    INPUT = "in"
    OUTPUT = "out"
    SCRATCH = "scratch"   # HBM the naive algorithm needs for its N x N intermediates
    LOCAL = "local"       # registers


class Stat(enum.Enum):
    """What an HBM buffer of one float32 per query row holds (None on other buffers)."""
    LSE = "lse"       # the log-sum-exp of the row's scores, natural log (a split's partial one too)
    DELTA = "delta"   # rowsum(dO * O), which the backward's dQ kernel writes and its dK/dV kernel reads
    SINK = "sink"     # (one float32 per query head) a learned logit that joins each row's softmax denominator


class DT(enum.Enum):
    F16 = "fp16"
    BF16 = "bf16"
    F32 = "fp32"
    I32 = "int32"
    F8E4M3 = "fp8_e4m3"  # float8 e4m3 (finite, max 448): Triton's float8e4nv, torch's float8_e4m3fn

    @property
    def bytes(self) -> int:
        return {DT.F16: 2, DT.BF16: 2, DT.F8E4M3: 1}.get(self, 4)

    @property
    def triton(self) -> str:
        return {DT.F16: "tl.float16", DT.BF16: "tl.bfloat16", DT.F32: "tl.float32", DT.I32: "tl.int32",
                DT.F8E4M3: "tl.float8e4nv"}[self]


@dataclass(frozen=True, slots=True)
class Buffer:
    """A named value: an HBM tensor or a register tile / vector / scalar (shape `()`)."""

    name: str
    shape: tuple[sympy.Expr, ...]
    dtype: DT
    space: Space
    role: Role = Role.LOCAL
    stat: Stat | None = None  # a per-row statistic: which

    @property
    def rank(self) -> int:
        return len(self.shape)


class SymKind(enum.Enum):
    SIZE = "size"            # a run-time integer argument (sequence lengths, batch, heads)
    CONSTEXPR = "constexpr"  # a compile-time integer (tile sizes, head dim)
    FLOAT = "float"          # a run-time float argument (the softmax scale)


@dataclass(frozen=True, slots=True)
class SymbolDecl:
    """A symbol a kernel takes as an argument. `derive` computes it from other sizes when no
    tensor dimension carries it; `specialize=False` keeps Triton from compiling a variant per value
    (sequence lengths and batch: one compiled kernel serves them all)."""

    symbol: sympy.Symbol
    kind: SymKind
    note: str = ""
    derive: sympy.Expr | None = None
    specialize: bool = True


# -- index expressions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Span:
    """`start + arange(size)` along one dimension, named like the code names it (offs_m, offs_n).

    `limit`, when set, is the exclusive bound past which elements are out of the tensor: loads read
    0 there and stores skip them. A pass that proves a span in bounds drops the limit.
    """

    name: str
    start: sympy.Expr
    size: sympy.Expr
    limit: sympy.Expr | None = None


@dataclass(frozen=True, slots=True)
class Paged:
    """Two dimensions (page, slot) of a paged cache, addressed through a block table:
    position `n` of sequence `batch` lives at page `table[batch, n // page_size]`, slot
    `n % page_size`."""

    table: Buffer
    batch: sympy.Expr
    span: Span
    page_size: int
    per_tile: bool = False  # the span never crosses a page: one table lookup per tile, not per row


@dataclass(frozen=True, slots=True)
class Packed:
    """Two dimensions (head, position) of a query-side tensor, addressed by one tile row (GQA
    packing): row `r` of `span` is head `head + r % group` at position `first + r // group`, so the
    query heads that share a key/value head fill one tile. `rows_first`: the position's dimension comes
    before the head's (a packed varlen tensor (TOTAL_Q, H, D), `first` the sequence's first row)."""

    head: sympy.Expr
    span: Span
    group: sympy.Expr
    first: sympy.Expr = sympy.Integer(0)
    rows_first: bool = False


@dataclass(frozen=True, slots=True)
class Ragged:
    """One dimension of a packed variable-length tensor (sequences laid end to end, `layout = varlen`):
    position `r` of `span` in its sequence is row `first + r` of the tensor, `first` the sequence's
    first row (CU_SEQLENS[b]). The span counts positions inside the sequence, as masks read them; the
    address counts rows of the packed tensor."""

    first: sympy.Expr
    span: Span


IndexItem = Union[sympy.Expr, Span, Paged, Packed, Ragged]


# -- tile expressions ----------------------------------------------------------------------------


class Op(enum.Enum):
    DOT = "dot"            # a @ b
    DOT_T = "dot_t"        # a @ b^T
    DOT_ACC = "dot_acc"    # c + a @ b (the accumulator form of the tensor-core instruction)
    TRANS = "trans"
    ADD = "+"
    SUB = "-"
    MUL = "*"
    DIV = "/"
    MAX = "max"
    EXP = "exp"
    EXP2 = "exp2"
    LOG = "log"
    LOG2 = "log2"
    ROWMAX = "rowmax"
    ROWSUM = "rowsum"
    COLMAX = "colmax"      # over the first axis: a [S, D] tile -> [D], a [S] vector -> a scalar
    COLSUM = "colsum"
    CAST = "cast"          # to the dtype in `Call.dtype`
    FINITE_OR_ZERO = "finite_or_zero"  # x where x > -inf else 0: keeps exp(-inf - -inf) out
    ONE_IF_ZERO = "one_if_zero"        # x where x != 0 else 1: normalising an empty row
    INF_IF_EMPTY = "inf_if_empty"      # +inf where x is -inf: a row with no visible key has
                                       # log-sum-exp -inf, and exp(s - (+inf)) = 0, not NaN
    LOAD = "load"          # HBM -> registers; `Call.index` says where


BINARY = {Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX}


@dataclass(frozen=True, slots=True)
class Ref:
    buffer: Buffer


@dataclass(frozen=True, slots=True)
class Num:
    value: float


@dataclass(frozen=True, slots=True)
class Sym:
    """A scalar symbolic value (an integer expression or a float argument such as the scale)."""

    expr: sympy.Expr


@dataclass(frozen=True, slots=True)
class Load:
    """Read `buffer[index]` from HBM; out-of-bounds elements (see `Span.limit`) read as `fill`
    (0, or -inf for a log-sum-exp that must weigh nothing). `descriptor`: the tile is read
    through a TMA tensor descriptor of the buffer when the launcher could make one (a bulk
    asynchronous copy, no per-element addresses), else through pointers (passes/tma.py)."""

    buffer: Buffer
    index: tuple[IndexItem, ...]
    fill: float = 0.0
    descriptor: bool = False


class PredKind(enum.Enum):
    CAUSAL = "causal"      # key <= query + offset
    KEY_BOUND = "key_bound"   # key < limit
    QUERY_BOUND = "query_bound"  # query < limit
    BAND = "band"          # bound(q_idx, k_idx) <= 0: one side of a monotone band (ir/variants.py)
    EXPR = "expr"          # bound(q_idx, k_idx, q_head, b) is true: a condition no block analysis bounds


@dataclass(frozen=True, slots=True)
class Pred:
    """One condition an element (query position, key position) must meet to be kept.

    A BAND predicate is `bound <= 0` with `bound` = +-k_idx + f(q_idx), f antitone when k_idx counts
    positively (an upper bound on the key that grows with the query) and monotone otherwise; `alt` is the
    same condition solved for the query, +-q_idx + g(k_idx) <= 0 with the same rule (None: not solvable, a
    loop over query blocks cannot narrow by it). An EXPR predicate's `bound` is a sympy boolean."""

    kind: PredKind
    bound: sympy.Expr  # the causal offset, or the limit; a BAND's key form; an EXPR's condition
    alt: sympy.Expr | None = None  # a BAND's query form

    def holds_for(self, query, key):
        """The condition as a linear inequality `coef_q*query + coef_k*key <= rhs` (the three linear kinds)."""
        if self.kind is PredKind.CAUSAL:
            return (-1, 1, self.bound)
        if self.kind is PredKind.KEY_BOUND:
            return (0, 1, self.bound - 1)
        if self.kind is PredKind.QUERY_BOUND:
            return (1, 0, self.bound - 1)
        raise ValueError(f"a {self.kind.value} predicate is not one linear inequality")

    def band(self, axis: str):
        """(c, f) with the predicate `c * x + f(y) <= 0` for x the `axis` position ("key" or "query") and y
        the other (f over the symbol y_idx of sym.py); c = 0 when it does not depend on x; None when the
        predicate cannot be solved for x (an EXPR, a BAND without a query form)."""
        x, y = (sym.k_idx, sym.q_idx) if axis == "key" else (sym.q_idx, sym.k_idx)
        if self.kind is PredKind.EXPR:
            return None
        if self.kind is PredKind.BAND:
            form = self.bound if axis == "key" else self.alt
            if form is None:
                return None
            form = sympy.sympify(form)
            c = form.coeff(x) if x in form.free_symbols else sympy.Integer(0)
            return int(c), sympy.expand(form - c * x)
        cq, ck, rhs = self.holds_for(None, None)
        c, co = (ck, cq) if axis == "key" else (cq, ck)
        return c, co * y - rhs


@dataclass(frozen=True, slots=True)
class Masked:
    """`value` where every predicate holds for (query, key), else `fill`.

    `query` and `key` are the spans of the tile's two axes; `query_axis` says which one is the row.
    """

    value: "Expr"
    preds: tuple[Pred, ...]
    query: Span
    key: Span
    query_axis: int = 0
    fill: float = float("-inf")
    query_group: sympy.Expr = sympy.Integer(1)  # rows per query position (GQA packing: row // group)


@dataclass(frozen=True, slots=True)
class Pointwise:
    """`fn` applied to every element of `value`: a score modifier (softcap, ALiBi, a spec's expression) or its
    derivative. `fn` is a sympy expression of sym.S (the element's value), sym.q_idx / sym.k_idx (its query
    row and key positions along the spans `query` and `key`; rows are positions // query_group under GQA
    packing), sym.q_head (its query head) and sym.b, and of reads of the run-time `tensors`, each spelled as
    the applied sympy function named after its buffer. `key` None: `value` is a vector of rows."""

    value: "Expr"
    fn: sympy.Expr
    query: Span
    key: Span | None
    query_axis: int = 0
    query_group: sympy.Expr = sympy.Integer(1)
    tensors: tuple[Buffer, ...] = ()
    score: bool = True  # fn's value is a score (exp2 converts it to base 2 with its argument), not a factor


@dataclass(frozen=True, slots=True)
class Call:
    op: Op
    args: tuple["Expr", ...]
    dtype: DT | None = None  # for CAST; for DOT*, the operand precision ("ieee" when fp32)


Expr = Union[Ref, Num, Sym, Load, Masked, Pointwise, Call]


# -- statements ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Assign:
    """`target = value`. A first assignment defines a register value; later ones update it."""

    target: Buffer
    value: Expr


@dataclass(frozen=True, slots=True)
class Store:
    """`target[index] = value` into HBM (`+=` when `accumulate`: only the naive backward, which
    sums dK/dV over a GQA group, uses it; no code is generated for it)."""

    target: Buffer
    index: tuple[IndexItem, ...]
    value: Expr
    accumulate: bool = False


@dataclass(frozen=True, slots=True)
class Softmax:
    """The naive row softmax: `probs = exp(scores - rowmax)`, with the row max and row sum.
    Exists only before the online-softmax rewrite; no code is generated for it."""

    probs: Buffer
    rowmax: Buffer
    rowsum: Buffer
    scores: Expr
    sink: Expr | None = None  # one more logit per row in the denominator (a learned sink), with no value


class LoopKind(enum.Enum):
    GRID = "grid"      # one program per iteration (a launch-grid axis)
    SERIAL = "for"     # a loop inside one program


@dataclass(frozen=True, slots=True)
class Loop:
    var: sympy.Symbol
    start: sympy.Expr
    stop: sympy.Expr
    step: sympy.Expr
    body: tuple["Stmt", ...]
    kind: LoopKind = LoopKind.SERIAL
    note: str = ""       # what the range is, in words ("full blocks", "diagonal blocks")
    aligned: bool = False  # every value of var is a multiple of step


@dataclass(frozen=True, slots=True)
class Comment:
    """A stage boundary, carried into the generated code."""

    text: str


@dataclass(frozen=True, slots=True)
class SequenceTile:
    """Which sequence `seq` and which of its tiles a program of a packed variable-length grid computes.

    The grid loop over `tile` numbers the tiles of all sequences together, each sequence's consecutively:
    sequence b's first tile is `offsets[b] // block + b` (`offsets`: the B + 1 int32 row offsets,
    CU_SEQLENS_Q or CU_SEQLENS_K), a bound on the tiles before it that needs no value from the GPU, so
    the grid is cdiv(total rows, block) + B programs. `seq` is the last b whose first tile is at or
    before `tile` (a binary search over `offsets`); then `facts`, scalars of that sequence (its first
    rows and lengths), are read; `start` = `start_value` is the tile's first row inside the sequence,
    and a program whose `start` is at or past `count` (a tile past the sequence's last) returns."""

    tile: sympy.Symbol
    offsets: Buffer
    block: sympy.Expr
    seq: sympy.Symbol
    facts: tuple[Assign, ...]
    start: sympy.Symbol
    start_value: sympy.Expr
    count: sympy.Expr


Stmt = Union[Assign, Store, Softmax, Loop, Comment, SequenceTile]


@dataclass(frozen=True, slots=True)
class KernelIR:
    """One GPU kernel of a `Program` (attn_fwd, attn_bwd_dq, ...): its parameters, symbols and body. Not the
    `attngen.Kernel` users call, which wraps a whole generated module."""

    name: str
    params: tuple[Buffer, ...]
    symbols: tuple[SymbolDecl, ...]
    body: tuple[Stmt, ...]
    doc: str = ""


# -- the Hopper kernels' shapes and thresholds (set by the warp-specialize passes) ---------------


@dataclass(frozen=True, slots=True)
class GluonShape:
    """One launch shape of a warp-specialised Gluon kernel: tile rows and keys, ring stages, consumer
    warpgroups, and the registers a consumer thread gets (`consumer_regs`) under the launch's `maxnreg`."""

    block_m: int
    block_n: int
    stages: int
    consumers: int
    consumer_regs: int
    maxnreg: int


@dataclass(frozen=True, slots=True)
class GluonForward:
    """The Gluon prefill forward (templates/gluon_forward.py.j2): `main` shape, and `short` for calls of at
    most `short_keys` keys; it runs from `min_keys` keys and `min_scores` scores B * H * N_Q * N_K."""

    main: GluonShape
    short: GluonShape
    loader_regs: int
    overlap: bool      # block j's Q K^T issued before block j-1's P V is waited for
    pingpong: bool     # the consumers take turns issuing
    early_p: bool      # P carried as the P V product's 16-bit operand
    trim: bool         # a consumer takes only the key blocks its rows need
    persistent: bool   # one program per multiprocessor
    balance: bool      # a persistent grid deals short tiles over its programs
    pair: bool         # a (batch, head)'s row blocks longest first, paired k-th longest with k-th shortest
    min_keys: int
    short_keys: int
    min_scores: int
    exp2_fma: float = 0.0  # share of a key block's columns whose exp2 runs on the FMA pipe (1/2^k; 0: none)
    # FP8: P's e4m3 operand relabelled from the scores' registers (no shuffles), its keys permuted within each 16,
    # and V^T's keys permuted alike by the launcher
    permute_p: bool = False
    # the Q and K tiles as column pieces of power-of-two widths, e.g. (128, 64) for DeepSeek's 192 (S is a product
    # per piece); (): one tile of the padded width
    pieces: tuple[int, ...] = ()
    # (variant programs) a score modifier adding c * |q - k + shift| (ALiBi) taken as a key term and a row term on
    # the blocks whose distances have one sign (analysis/distance.py)
    distance: bool = False
    # (variant programs) the same where the sign differs between blocks: each block's corners decide its form
    distance_by_block: bool = False
    # (variant programs without a score modifier) the running max over the raw scores, the scale in exp2's FMA
    raw_max: bool = False

    @property
    def exp2_fma_halvings(self) -> int:
        """k of exp2_fma = 1/2^k: how many times the score tile is halved (its last part emulated); 0: none."""
        return 0 if not self.exp2_fma else round(1 / self.exp2_fma).bit_length() - 1

    def constants(self) -> dict:
        """The generated module's WS_SHAPE: what its launcher reads at run time (EXP2_FMA and PIECES only where set: the
        other modules' constants stay as they were)."""
        m, s = self.main, self.short
        return {"BLOCK_M": m.block_m, "BLOCK_N": m.block_n, "STAGES": m.stages, "OVERLAP": self.overlap,
                "PINGPONG": self.pingpong, "EARLY_P": self.early_p, "TRIM": self.trim, "PERSISTENT": self.persistent,
                "consumers": m.consumers, "consumer_regs": m.consumer_regs, "loader_regs": self.loader_regs,
                "maxnreg": m.maxnreg, "SHORT_BLOCK_M": s.block_m, "SHORT_BLOCK_N": s.block_n,
                "SHORT_STAGES": s.stages, "SHORT_consumers": s.consumers, "SHORT_consumer_regs": s.consumer_regs,
                "SHORT_maxnreg": s.maxnreg, "min_keys": self.min_keys, "short_keys": self.short_keys,
                "min_scores": self.min_scores, "BALANCE": self.balance,
                **({"EXP2_FMA": self.exp2_fma} if self.exp2_fma else {}),
                **({"PERMUTE_P": True} if self.permute_p else {}),
                **({"PIECES": list(self.pieces)} if self.pieces else {})}


@dataclass(frozen=True, slots=True)
class GluonBackward:
    """The Gluon backward (templates/gluon_backward.py.j2): dQ, dK and dV in one kernel, `main` shape and
    `short` for calls of at most `short_keys` keys; the row passes around it take `row_block` rows."""

    main: GluonShape
    short: GluonShape
    loader_regs: int
    ahead: bool          # the next step's S^T issued first
    dq_atomic: bool      # dQ added by TMA reductions here (else dK, dV only)
    rows_smem: bool      # lse and delta by TMA with Q and dO
    prefetch: bool       # (without rows_smem) the next step's lse and delta loaded during this one
    late_rows: int       # 0: lse, delta read before the step's waits; 1: delta after; 2: lse too
    split: bool          # dK, dV from this kernel beside the Triton dQ kernel (deterministic algorithms)
    dq_local_rows: int   # from this many query rows, each consumer makes dQ over its own keys; 0: never
    dq_claim_keys: int   # up to this many keys, dQ tiles are claimed instead of zeroed; 0: never
    row_block: int
    min_keys: int
    short_keys: int
    min_scores: int
    max_group_split: int = 1  # at most this many programs share a GQA group's query heads (1: never split)
    wide: bool = False   # both consumers on the same block_n keys, each half of dK/dV's columns (d=256)
    # (wide only) the Q and K tiles as column pieces of power-of-two widths, e.g. (128, 64) for DeepSeek's 192:
    # consumer i holds piece i's columns of dK and dQ (the last one V's too); (): one tile of the padded width
    pieces: tuple[int, ...] = ()
    order_heads: int = 0  # varlen: 0 the packed key tiles in order; k: most query blocks first, k K/V heads at a time
    order_tiles: int = 0  # with order_heads: launches of more key tiles a head than this keep the packed order
    # varlen: a warpgroup's K and V rows past its sequence zeroed by one load and store of its whole tile, not
    # 16 rows at a time (fewer ptxas spills in the loop after it)
    zero_whole: bool = False
    # varlen, ordered: a persistent grid (a program a multiprocessor taking the order's work items in turn), dK and
    # dV out through the dQ buffers while the next tile's K and V load
    persistent: bool = False
    # varlen: a masked block's scores masked on S^T before the exponential, as the dense kernel does (where no score
    # modifier sits between them), and the rows' delta past a sequence left unmasked: the rows' descriptor ends
    # where the row pass's writes do, so what a tile reads there is finite (fewer ptxas spills in the loop)
    mask_scores: bool = False
    # (wide, not staged) a program takes two key tiles, the k-th longest and the k-th shortest of a causal head, its
    # Q/dO ring running on from the first into the second (half the programs, each the same work), but for the last
    # (batch, head)s of a launch, whose single tiles fill its last `pair_tail_waves` waves of programs
    paired: bool = False
    pair_tail_waves: int = 0
    # (variant programs) a score modifier adding c * |q - k + shift| (ALiBi) taken as a key term and a query term on
    # the blocks whose distances have one sign (analysis/distance.py)
    distance: bool = False
    # (variant programs) the same where the sign differs between steps: each step's corners decide its form
    distance_by_block: bool = False

    def constants(self) -> dict:
        """The generated module's WS_BWD_SHAPE: what its launcher reads at run time ("wide", "PIECES", "ORDER_HEADS" and
        "PAIRED" only where set: the other modules' constants stay as they were)."""
        m, s = self.main, self.short
        return {"BLOCK_M": m.block_m, "BLOCK_N": m.block_n, "AHEAD": self.ahead, "consumers": m.consumers,
                "consumer_regs": m.consumer_regs, "loader_regs": self.loader_regs, "maxnreg": m.maxnreg,
                "DQ_ATOMIC": self.dq_atomic, "ROWS_SMEM": self.rows_smem, "STAGES": m.stages,
                "PREFETCH": self.prefetch, "dq_local_rows": self.dq_local_rows, "split": self.split,
                "min_keys": self.min_keys, "min_scores": self.min_scores, "ROW_BLOCK": self.row_block,
                "LATE_ROWS": self.late_rows, "dq_claim_keys": self.dq_claim_keys, "short_keys": self.short_keys,
                "SHORT_BLOCK_N": s.block_n, "SHORT_STAGES": s.stages, "SHORT_consumers": s.consumers,
                "SHORT_consumer_regs": s.consumer_regs, "SHORT_maxnreg": s.maxnreg,
                "max_group_split": self.max_group_split, **({"wide": True} if self.wide else {}),
                **({"PIECES": list(self.pieces)} if self.pieces else {}),
                **({"ORDER_HEADS": self.order_heads, "ORDER_TILES": self.order_tiles} if self.order_heads else {}),
                **({"PAIRED": True, "PAIR_TAIL_WAVES": self.pair_tail_waves} if self.paired else {})}


@dataclass(frozen=True, slots=True)
class GluonDecode:
    """The Gluon KV-cache decode kernel (templates/gluon_decode.py.j2): blocks of `block_n` keys in a ring of
    `stages`, at most `rows` query rows per K/V head, `consumers` warpgroups sharing each block (each its
    block_n / consumers keys of S^T and head_dim / consumers rows of O^T), an FP8 cache's e4m3 widened by
    sign-extending byte permutes where `widen_by_sign` (else by masks), and its K and V tiles widened into 16-bit
    shared tiles that wgmma reads where `stage_k`, `stage_v` (else wgmma's A operand in registers), K's register
    operand read 16 bytes a load where `permute_k` (the head dim permuted in K and Q alike). `halves` (two
    consumers): each consumer warpgroup a partition of its own over half of every block's keys with a softmax state of
    its own, the two merged at the end, instead of the M of both products split between them. `split_loader`: K's
    copies and V's each issued by a loader warp of its own (a paged cache's are a copy a page). `q_e4m3` (an FP8
    cache, 0 off): the queries as `q_e4m3` e4m3 terms a row (1: rounded; 2: that and the rounding's remainder rounded,
    about a 16-bit value's bits), scaled by a power of two a row, so that S^T = K Q^T is e4m3 products of two
    shared-memory operands, K's block not widened, each column scaled back by its row's factor; `p_e4m3`
    (with it) P^T rounded to e4m3 (times 2^8) so that O^T += V^T P^T is an e4m3 product too, V^T's bytes not widened.
    `one_wave`: its launch's split count is the one-wave rule's (policy/splits.py choose_wave_splits: programs x
    splits within the multiprocessors), each program holding one with a ring deep enough for its loads."""

    block_n: int
    stages: int
    rows: int
    loader_regs: int
    consumers: int = 1
    widen_by_sign: bool = False
    stage_k: bool = False
    stage_v: bool = False
    permute_k: bool = False
    halves: bool = False
    split_loader: bool = False
    q_e4m3: int = 0
    p_e4m3: bool = False
    one_wave: bool = False
    # (halves: the consumer partitions' registers, the loader's loader_regs, launched at maxnreg)
    consumer_regs: int = 240
    maxnreg: int = 168

    def constants(self) -> dict:
        """The generated module's WSD_SHAPE: what its launcher reads at run time ("CONSUMERS" only where more than
        one, the partitions' registers where `halves`: the other modules' constants stay as they were)."""
        return {"BLOCK_N": self.block_n, "STAGES": self.stages, "ROWS": self.rows, "loader_regs": self.loader_regs,
                **({"CONSUMERS": self.consumers} if self.consumers > 1 else {}),
                **({"HALVES": True, "consumer_regs": self.consumer_regs, "maxnreg": self.maxnreg}
                   if self.halves else {}), **({"Q_E4M3": self.q_e4m3} if self.q_e4m3 else {}),
                **({"ONE_WAVE": True} if self.one_wave else {})}


@dataclass(frozen=True, slots=True)
class GluonMlaDecode:
    """The Gluon MLA decode kernel (templates/gluon_mla_decode.py.j2): programs of `rows` packed query rows of one
    latent head over one split's keys in blocks of `block_n` (a ring of `stages` whole latent tiles), `consumers`
    warpgroups of `consumer_regs` registers beside a loader warp of `loader_regs`, launched at `maxnreg`; taken by
    calls with at least `min_rows` packed query rows a latent head (fewer: the Triton kernel's narrower tiles).
    `overlap`: each consumer issues the next block's S = Q K^T before this block's softmax and P V, and waits for
    both at the block's end (off: it waits for each product as it issues it). `seesaw`: the consumers take blocks in
    pairs, consumer 0 the first's whole S and softmax, consumer 1 the second's, each adding both blocks' P V into its
    half of the value columns (FlashMLA's schedule: one warpgroup's softmax beside the other's products).
    `defer_pv` (serial only): block j's P V is waited for after block j + 1's S is issued, not before."""

    block_n: int
    stages: int
    rows: int
    consumers: int
    consumer_regs: int
    loader_regs: int
    maxnreg: int
    min_rows: int = 1
    overlap: bool = False
    seesaw: bool = False
    defer_pv: bool = False

    def constants(self) -> dict:
        """The generated module's WSM_SHAPE: what its launcher reads at run time."""
        return {"BLOCK_N": self.block_n, "STAGES": self.stages, "ROWS": self.rows, "consumers": self.consumers,
                "consumer_regs": self.consumer_regs, "loader_regs": self.loader_regs, "maxnreg": self.maxnreg,
                "MIN_ROWS": self.min_rows, **({"SEESAW": True} if self.seesaw else {}),
                **({"DEFER_PV": True} if self.defer_pv else {})}


@dataclass(frozen=True, slots=True)
class WarpSpecialized:
    """Which Hopper Gluon kernels a program has beside its Triton ones, with their shapes; None: none."""

    forward: GluonForward | None = None
    backward: GluonBackward | None = None
    decode: GluonDecode | None = None
    mla: GluonMlaDecode | None = None

    def __bool__(self) -> bool:
        return any(k is not None for k in (self.forward, self.backward, self.decode, self.mla))


@dataclass(frozen=True, slots=True)
class TritonBackward:
    """What the Triton backward's launcher chooses at run time (pass group-split): at most `max_group_split`
    programs of `attn_bwd_dkdv_split` share a GQA group's query heads (1: never split; no such kernel), whose
    float32 parts a pass after sums in programs of `sum_block` key rows."""

    max_group_split: int = 1
    sum_block: int = 0

    def constants(self) -> dict:
        """The generated module's TRITON_BWD_SHAPE: what its launcher reads at run time."""
        return {"max_group_split": self.max_group_split, "SUM_BLOCK": self.sum_block}


@dataclass(frozen=True, slots=True)
class Program:
    """Everything generated from one spec: its kernels, and facts the passes agreed on."""

    name: str
    spec_hash: str
    kernels: tuple[KernelIR, ...]
    attrs: tuple[tuple[str, object], ...] = field(default=())
    warp_specialized: WarpSpecialized = WarpSpecialized()
    triton_backward: TritonBackward = TritonBackward()

    def attr(self, key: str, default=None):
        return dict(self.attrs).get(key, default)

    def with_attrs(self, **updates) -> "Program":
        merged = dict(self.attrs)
        merged.update(updates)
        return replace(self, attrs=tuple(sorted(merged.items())))

    def kernel(self, name: str) -> KernelIR:
        for k in self.kernels:
            if k.name == name:
                return k
        raise KeyError(name)

    def replace_kernel(self, new: KernelIR) -> "Program":
        return replace(self, kernels=tuple(new if k.name == new.name else k for k in self.kernels))


# -- traversal helpers ---------------------------------------------------------------------------


def walk_stmts(body: tuple[Stmt, ...]) -> Iterator[Stmt]:
    for stmt in body:
        yield stmt
        if isinstance(stmt, Loop):
            yield from walk_stmts(stmt.body)
        elif isinstance(stmt, SequenceTile):
            yield from stmt.facts


def walk_expr(expr: Expr) -> Iterator[Expr]:
    yield expr
    if isinstance(expr, Call):
        for a in expr.args:
            yield from walk_expr(a)
    elif isinstance(expr, (Masked, Pointwise)):
        yield from walk_expr(expr.value)


def stmt_exprs(stmt: Stmt) -> tuple[Expr, ...]:
    if isinstance(stmt, (Assign, Store)):
        return (stmt.value,)
    if isinstance(stmt, Softmax):
        return (stmt.scores,) if stmt.sink is None else (stmt.scores, stmt.sink)
    return ()


def map_expr(expr: Expr, fn) -> Expr:
    """Rebuild `expr` bottom-up, replacing each node by `fn(node)` (which may return it unchanged)."""
    if isinstance(expr, Call):
        expr = replace(expr, args=tuple(map_expr(a, fn) for a in expr.args))
    elif isinstance(expr, (Masked, Pointwise)):
        expr = replace(expr, value=map_expr(expr.value, fn))
    return fn(expr)


def map_stmts(body: tuple[Stmt, ...], fn) -> tuple[Stmt, ...]:
    """Rebuild a body, calling `fn(stmt)` on every statement (inner loops first); `fn` returns a
    statement or a tuple of statements to splice in."""
    out: list[Stmt] = []
    for stmt in body:
        if isinstance(stmt, Loop):
            stmt = replace(stmt, body=map_stmts(stmt.body, fn))
        new = fn(stmt)
        out.extend(new if isinstance(new, tuple) else (new,))
    return tuple(out)


def map_exprs_in(body: tuple[Stmt, ...], fn) -> tuple[Stmt, ...]:
    """Apply `map_expr(..., fn)` to every expression of every statement."""

    def visit(stmt: Stmt) -> Stmt:
        if isinstance(stmt, Assign):
            return replace(stmt, value=map_expr(stmt.value, fn))
        if isinstance(stmt, Store):
            return replace(stmt, value=map_expr(stmt.value, fn))
        if isinstance(stmt, Softmax):
            sink = None if stmt.sink is None else map_expr(stmt.sink, fn)
            return replace(stmt, scores=map_expr(stmt.scores, fn), sink=sink)
        return stmt

    return map_stmts(body, visit)


def subs_stmts(body: tuple[Stmt, ...], mapping: dict) -> tuple[Stmt, ...]:
    """Substitute symbols everywhere in a body: bounds, indices, spans, predicates."""

    def s(e):
        return sympy.sympify(e).subs(mapping) if e is not None else None

    def span(sp: Span) -> Span:
        return replace(sp, start=s(sp.start), size=s(sp.size), limit=s(sp.limit))

    def item(it):
        if isinstance(it, Span):
            return span(it)
        if isinstance(it, Paged):
            return replace(it, batch=s(it.batch), span=span(it.span))
        if isinstance(it, Packed):
            return replace(it, head=s(it.head), span=span(it.span), group=s(it.group), first=s(it.first))
        if isinstance(it, Ragged):
            return replace(it, first=s(it.first), span=span(it.span))
        return s(it)

    def expr(e):
        if isinstance(e, Load):
            return replace(e, index=tuple(item(i) for i in e.index))
        if isinstance(e, Sym):
            return Sym(s(e.expr))
        if isinstance(e, Masked):
            return replace(
                e,
                preds=tuple(replace(p, bound=s(p.bound), alt=s(p.alt)) for p in e.preds),
                query=span(e.query),
                key=span(e.key),
                query_group=s(e.query_group),
            )
        if isinstance(e, Pointwise):
            return replace(e, fn=s(e.fn), query=span(e.query), key=span(e.key) if e.key is not None else None,
                           query_group=s(e.query_group))
        return e

    def stmt(st):
        if isinstance(st, Loop):
            return replace(st, start=s(st.start), stop=s(st.stop), step=s(st.step))
        if isinstance(st, Store):
            return replace(st, index=tuple(item(i) for i in st.index))
        return st

    return map_stmts(map_exprs_in(body, expr), stmt)


# -- shapes --------------------------------------------------------------------------------------


def index_shape(index: tuple[IndexItem, ...]) -> tuple[sympy.Expr, ...]:
    return tuple(i.size if isinstance(i, Span) else i.span.size for i in index
                 if isinstance(i, (Span, Paged, Packed, Ragged)))


def index_dims(index: tuple[IndexItem, ...]) -> int:
    """How many tensor dimensions an index addresses (Paged and Packed items cover two)."""
    return sum(2 if isinstance(i, (Paged, Packed)) else 1 for i in index)


def shape_of(expr: Expr) -> tuple[sympy.Expr, ...]:
    """The shape of a tile expression; rank-1 operands broadcast against rank-2 ones by size."""
    if isinstance(expr, Ref):
        return expr.buffer.shape
    if isinstance(expr, (Num, Sym)):
        return ()
    if isinstance(expr, Load):
        return index_shape(expr.index)
    if isinstance(expr, (Masked, Pointwise)):
        return shape_of(expr.value)
    op, args = expr.op, expr.args
    if op is Op.DOT:
        return (shape_of(args[0])[0], shape_of(args[1])[1])
    if op is Op.DOT_T:
        return (shape_of(args[0])[0], shape_of(args[1])[0])
    if op is Op.DOT_ACC:
        return shape_of(args[2])
    if op is Op.TRANS:
        a = shape_of(args[0])
        return (a[1], a[0])
    if op in (Op.ROWMAX, Op.ROWSUM):
        return shape_of(args[0])[:1]
    if op in (Op.COLMAX, Op.COLSUM):
        return shape_of(args[0])[1:]
    shapes = [shape_of(a) for a in args]
    return max(shapes, key=len)


def dtype_of(expr: Expr) -> DT:
    if isinstance(expr, Ref):
        return expr.buffer.dtype
    if isinstance(expr, Load):
        return expr.buffer.dtype
    if isinstance(expr, (Num, Sym)):
        return DT.F32
    if isinstance(expr, Masked):
        return dtype_of(expr.value)
    if isinstance(expr, Pointwise):
        return DT.F32
    if expr.op is Op.CAST:
        return expr.dtype
    if expr.op in (Op.DOT, Op.DOT_T, Op.DOT_ACC):
        return DT.F32
    return max((dtype_of(a) for a in expr.args), key=lambda d: d.bytes)


# -- text form -----------------------------------------------------------------------------------


def _e(x) -> str:
    return sympy.sstr(x)


def format_span(sp: Span) -> str:
    text = f"{_e(sp.start)}:+{_e(sp.size)}" if sp.start != 0 else f":{_e(sp.size)}"
    return text + (f" (<{_e(sp.limit)})" if sp.limit is not None else "")


def format_index(index: tuple[IndexItem, ...]) -> str:
    parts = []
    for it in index:
        if isinstance(it, Span):
            parts.append(format_span(it))
        elif isinstance(it, Paged):
            lookup = ", per tile" if it.per_tile else ""
            parts.append(f"page({it.table.name}[{_e(it.batch)}], {format_span(it.span)}, size={it.page_size}{lookup})")
        elif isinstance(it, Packed):
            rows = f", first={_e(it.first)}" if it.first != 0 else ""
            rows += ", rows first" if it.rows_first else ""
            parts.append(f"packed({_e(it.head)}, {format_span(it.span)}, group={_e(it.group)}{rows})")
        elif isinstance(it, Ragged):
            parts.append(f"{_e(it.first)} + ({format_span(it.span)})")
        else:
            parts.append(_e(it))
    return "[" + ", ".join(parts) + "]"


def format_pred(p: Pred) -> str:
    if p.kind is PredKind.CAUSAL:
        return f"key <= query + {_e(p.bound)}" if p.bound != 0 else "key <= query"
    if p.kind is PredKind.KEY_BOUND:
        return f"key < {_e(p.bound)}"
    if p.kind is PredKind.BAND:
        return f"{_e(p.bound)} <= 0"
    if p.kind is PredKind.EXPR:
        return f"({_e(p.bound)})"
    return f"query < {_e(p.bound)}"


def format_expr(e: Expr) -> str:
    if isinstance(e, Ref):
        return e.buffer.name
    if isinstance(e, Num):
        return {float("inf"): "inf", float("-inf"): "-inf"}.get(e.value, repr(e.value))
    if isinstance(e, Sym):
        return _e(e.expr)
    if isinstance(e, Load):
        fill = f" (else {format_expr(Num(e.fill))})" if e.fill != 0.0 else ""
        via = " via descriptor" if e.descriptor else ""
        return f"load {e.buffer.name}{format_index(e.index)}{fill}{via}"
    if isinstance(e, Masked):
        preds = " and ".join(format_pred(p) for p in e.preds)
        fill = format_expr(Num(e.fill))
        rows = f", query = row // {_e(e.query_group)}" if e.query_group != 1 else ""
        return f"mask({format_expr(e.value)}, keep {preds}{rows}, else {fill})"
    if isinstance(e, Pointwise):
        rows = f", query = row // {_e(e.query_group)}" if e.query_group != 1 else ""
        return f"pointwise({format_expr(e.value)}, s -> {_e(e.fn)}{rows})"
    op, args = e.op, e.args
    if op in BINARY and op is not Op.MAX:
        a, b = (format_expr(x) for x in args)
        wrap = lambda s, x: f"({s})" if isinstance(x, Call) and x.op in BINARY and x.op is not Op.MAX else s
        return f"{wrap(a, args[0])} {op.value} {wrap(b, args[1])}"
    if op is Op.CAST:
        return f"cast<{e.dtype.value}>({format_expr(args[0])})"
    if op in (Op.DOT, Op.DOT_T, Op.DOT_ACC) and e.dtype is DT.F32:
        return f"{op.value}<ieee>(" + ", ".join(format_expr(a) for a in args) + ")"
    return f"{op.value}(" + ", ".join(format_expr(a) for a in args) + ")"


def format_buffer_type(b: Buffer) -> str:
    dims = ", ".join(_e(d) for d in b.shape)
    return f"{b.space.value} {b.dtype.value}[{dims}]"


def describe_buffer(b: Buffer) -> str:
    """The type with the role: for messages, where two buffers of one type may differ in role."""
    return f"{b.role.value} {format_buffer_type(b)}"


def _format_body(body, indent: int, defined: set, out: list) -> None:
    pad = "  " * indent
    for st in body:
        if isinstance(st, Comment):
            out.append(f"{pad}# {st.text}")
        elif isinstance(st, Loop):
            rng = f"[{_e(st.start)}, {_e(st.stop)})" + (f" step {_e(st.step)}" if st.step != 1 else "")
            note = f"    # {st.note}" if st.note else ""
            out.append(f"{pad}{st.kind.value} {st.var} in {rng}:{note}")
            _format_body(st.body, indent + 1, defined, out)
        elif isinstance(st, Assign):
            t = st.target
            decl = "" if t.name in defined else f": {format_buffer_type(t)}"
            defined.add(t.name)
            out.append(f"{pad}{t.name}{decl} = {format_expr(st.value)}")
        elif isinstance(st, Store):
            op = "+=" if st.accumulate else "="
            out.append(f"{pad}store {st.target.name}{format_index(st.index)} {op} {format_expr(st.value)}")
        elif isinstance(st, SequenceTile):
            out.append(f"{pad}{st.seq} = last b with {st.offsets.name}[b] // {_e(st.block)} + b <= {st.tile}"
                       f"    # programs -> (sequence, tile): each sequence's tiles numbered consecutively")
            _format_body(st.facts, indent, defined, out)
            out.append(f"{pad}{st.start} = {_e(st.start_value)}")
            out.append(f"{pad}return if {st.start} >= {_e(st.count)}    # past the sequence's last tile")
        elif isinstance(st, Softmax):
            for b in (st.probs, st.rowmax, st.rowsum):
                defined.add(b.name)
            sink = f", sink {format_expr(st.sink)}" if st.sink is not None else ""
            out.append(
                f"{pad}{st.probs.name}: {format_buffer_type(st.probs)}, {st.rowmax.name}, {st.rowsum.name}"
                f" = softmax_rows({format_expr(st.scores)}{sink})"
            )


def format_kernel(k: KernelIR) -> str:
    out = [f"kernel {k.name}:" + (f"    # {k.doc}" if k.doc else "")]
    for p in k.params:
        out.append(f"  {p.role.value} {p.name}: {format_buffer_type(p)}")
    for kind, label in ((SymKind.SIZE, "sizes"), (SymKind.CONSTEXPR, "constexpr"), (SymKind.FLOAT, "scalars")):
        names = [str(d.symbol) for d in k.symbols if d.kind is kind]
        if names:
            out.append(f"  {label} " + ", ".join(names))
    _format_body(k.body, 1, {p.name for p in k.params}, out)
    return "\n".join(out)


def _format_shape(s: GluonShape) -> str:
    return (f"{s.block_m}x{s.block_n} tiles, {s.stages} stages, {s.consumers} consumers x {s.consumer_regs} regs"
            f" (maxnreg {s.maxnreg})")


_PRINTED_WHERE_SET = ("order_heads", "order_tiles", "pair_tail_waves")  # (the varlen backward's order, the wide
# backward's pairs: printed where set)


def format_warp_specialized(ws: WarpSpecialized) -> list[str]:
    """The Gluon kernels' shapes and thresholds, a few lines each."""
    out = []
    for name, k in (("forward", ws.forward), ("backward", ws.backward)):
        if k is None:
            continue
        flags = [f.name for f in fields(k) if isinstance(getattr(k, f.name), bool) and getattr(k, f.name)]
        numbers = [f"{f.name}={getattr(k, f.name)}" for f in fields(k)
                   if type(getattr(k, f.name)) is int and f.name not in ("loader_regs", "min_keys", "short_keys", "min_scores")
                   and (getattr(k, f.name) or f.name not in _PRINTED_WHERE_SET)
                   or type(getattr(k, f.name)) is float and getattr(k, f.name)]  # (a share: where set)
        out += [f"gluon {name}: {_format_shape(k.main)}, loader {k.loader_regs} regs",
                f"  short (<= {k.short_keys} keys): {_format_shape(k.short)}" if k.short_keys else "  short: never",
                f"  runs from {k.min_keys} keys and {k.min_scores} scores; " + ", ".join(flags + numbers)]
    if ws.decode is not None:
        d = ws.decode
        out.append(f"gluon decode: {d.block_n}-key blocks, {d.stages} stages, <= {d.rows} rows per K/V head, "
                   f"loader {d.loader_regs} regs" + (f", {d.consumers} consumer warpgroups" if d.consumers > 1 else "")
                   + (", e4m3 widened by sign" if d.widen_by_sign else "")
                   + "".join(f", {t} widened in shared memory" for t, on in (("K", d.stage_k), ("V", d.stage_v)) if on)
                   + (", K's head dim permuted" if d.permute_k else "")
                   + (f", each a partition over half of every block's keys ({d.consumer_regs} regs, maxnreg "
                      f"{d.maxnreg}), merged at the end" if d.halves else "")
                   + (", K's and V's copies from a loader warp each" if d.split_loader else "")
                   + ({0: "", 1: ", Q rounded to e4m3 a row (S^T an e4m3 product, K not widened)",
                       2: ", Q as two e4m3 terms a row (S^T two e4m3 products, K not widened)"}[d.q_e4m3])
                   + (", split into one wave" if d.one_wave else "")
                   + (", P^T rounded to e4m3 (P V an e4m3 product, V not widened)" if d.p_e4m3 else ""))
    if ws.mla is not None:
        m = ws.mla
        out.append(f"gluon MLA decode: {m.rows}x{m.block_n} tiles (packed query rows x keys), {m.stages} stages, "
                   f"{m.consumers} consumers x {m.consumer_regs} regs (maxnreg {m.maxnreg}), loader {m.loader_regs} regs, "
                   f"from {m.min_rows} packed rows" + (", the next block's S overlapped" if m.overlap else "")
                   + (", blocks in seesaw pairs" if m.seesaw else ""))
    return out


def format_program(p: Program) -> str:
    attrs = ", ".join(f"{k}={v}" for k, v in p.attrs)
    head = f"program {p.name} [{p.spec_hash}]" + (f" ({attrs})" if attrs else "")
    head = "\n".join([head] + format_warp_specialized(p.warp_specialized))
    if p.triton_backward.max_group_split > 1:
        t = p.triton_backward
        head += f"\ntriton backward: max_group_split={t.max_group_split}, sum_block={t.sum_block}"
    return "\n\n".join([head] + [format_kernel(k) for k in p.kernels]) + "\n"
