"""`generate`, the host API: validation, sizing, the compiled programs, timing, stats.

Two compiled programs per shape bucket: `DecodeLoop.prefill` and `DecodeLoop.run` (the
whole rest of the generation, the loop state donated). The host sees only the final
buffers; timing the two apart gives TTFT and TPOT.

generate's arguments:
  prompts: token-id lists (a ragged batch) or strings (needs `model.tokenizer`).
  temperature, top_k, top_p, min_p: the distribution a sampled row draws from
    (`specjax.sampling`; 0, 0, 1 and 0 turn each off); a speculator's drafts are
    verified against that same distribution.
  seed: an int (row r draws from this seed folded with r) or one int per prompt; rows
    draw from keys of their own (`specjax.rng`), so a row given seed s in a list samples
    the same tokens alone or in any batch, plain or with a speculator. With a list and
    temperature > 0 the adaptive rule also decides each row as if it ran alone
    (`Rule.per_row`); greedy tokens do not depend on the depth drafted, so at
    temperature 0 the rule prices the batch's forward whatever the seed.
  eos_id: stop tokens; None uses the config's `eos_token_id` (as transformers does);
    `ignore_eos=True` generates exactly `max_new_tokens`.
  speculator: a `specjax.speculators` instance; output is identical to target-only
    greedy decoding at temperature 0 and distributed as the target at any temperature.
  verification: how sampled drafts are verified (`specjax.verify`): "rejection"
    (token-wise, lossless), "block" (chains only, lossless, accepts at least as many
    tokens in expectation), "typical" (Medusa's, LOSSY); None: the speculator's own,
    "block" where that is "rejection" and the speculator proposes chains.
  adaptive: per-row draft depth from running acceptance and the speculator's cost ratio.
    Where the rule, from its prior, would keep every row at k = 0 with no probe worth
    running, no row can ever draft, so the call runs plain decoding's programs
    (`policy.may_draft`).
  cost_ratio: one draft call's cost relative to a one-token target step (None: the
    speculator's parameter-count estimate; `specjax.calibrate.measured_cost_ratio`
    measures one), for the adaptive rule and the analytical speedup.
  verify_cost: a `specjax.VerifyCost` (None: this backend's `VERIFY_COST`, on CPU the
    table for the matmuls the model runs, `default_verify_cost`; `VerifyCost()` is
    Leviathan et al.'s free verify), for the adaptive rule and the analytical speedup.
  step_overhead: what a speculative step costs beyond its draft calls and verify
    forward, in one-token target steps (None: 0), for the adaptive rule and the
    analytical speedup: one number for every depth, or one per draft depth 1..max_depth
    (building and reranking a deeper tree costs more); `specjax.calibrate.calibration`
    measures it per depth.
  idle_overhead: what a step that drafts nothing costs inside the speculative loop beyond
    a plain decoding step (the speculator's commit and queue calls, the loop's control
    flow), in one-token target steps (None: 0); a row at k = 0 keeps probing only where
    the chance that its probes turn drafting on covers it (`policy.probe_value`), else
    the call runs plain decoding's programs. `specjax.calibrate.calibration` measures it.
  probe_gap: steps a row at k = 0 waits before its first probe, the gap doubling after
    each rejected probe (None: `policy.PROBE_GAP`).
  acceptance_prior: the acceptance α_d per draft depth the adaptive rule starts from
    (None, or None / NaN entries: the default); a calibration run's
    `stats.acceptance_by_position` makes a good draft draft deep from its first step.
  prior_tries: the tries each acceptance_prior entry was measured from (None, or None
    entries: unknown); a calibration's `stats.tried_hist`, or fewer where its prompts
    disagree (`specjax.calibrate.effective_tries`). Whether the call runs the speculative
    loop at all is decided at the prior's lower confidence bound
    (`policy.cautious_prior`), so a prior from a few prompts must show a margin.
  proposal_prior: the rate at which the speculator finds a draft when asked, which the
    rule starts from (None: 1); a calibration run's `stats.proposal_rate`. At batch > 1
    a row whose n-gram finds nothing still pays the batch's verify.
  layer_layout: "auto", "scan", "in_place" or "unrolled" (`specjax.model.decode_params`).
  prefill_chunk: the most prompt tokens one prefill forward takes (`prefill_chunks`).
  num_pages: cache pages in the pool (default: exactly what the batch needs); on a mesh
    whose `data` axis splits the rows, split evenly between the data shards.
  kv_cache_dtype: the target's and the speculator's KV pages, as vLLM's: None, a float
    dtype, or "int8" (`specjax.kv_quant`; lossless against the target over that cache).
  kv_commit: how verified KV is committed (`specjax.decoding.commit`): "write-kept",
    "compact", or None for the backend's default.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_quant, rng, sampling as sampling_lib
from specjax.cache import PagePool
from specjax.decoding import commit as commit_lib
from specjax.decoding.cost import VerifyCost, default_verify_cost
from specjax.decoding.loop import DecodeLoop
from specjax.decoding.policy import PROBE_GAP, Rule, attended_tokens, may_draft, prior_gain
from specjax.decoding.programs import LayoutCache, ProgramCache
from specjax.decoding.state import Params, Prompt
from specjax.model import Model, validate_tokens
from specjax.sharding import rules as shard
from specjax.speculators.base import Speculator
from specjax.stats import GenerationStats, build_stats
from specjax.verify import METHODS


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated ids per row, prompt excluded (EOS kept if hit)
    text: list[str] | None
    stats: GenerationStats


PROGRAMS = ProgramCache()  # generate's; tests clear it between modules
LAYOUTS = LayoutCache()  # likewise


def generate(model: Model, prompts, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             seed: int | Sequence[int] = 0,
             eos_id: int | Sequence[int] | None = None, ignore_eos: bool = False,
             speculator: Speculator | None = None, verification: str | None = None,
             adaptive: bool = True, cost_ratio: float | None = None,
             verify_cost: VerifyCost | None = None,
             step_overhead: float | Sequence[float] | None = None,
             idle_overhead: float | None = None, probe_gap: int | None = None,
             acceptance_prior: Sequence[float | None] | None = None,
             proposal_prior: float | None = None,
             prior_tries: Sequence[float | None] | None = None, layer_layout: str = "auto",
             page_size: int = 16, num_pages: int | None = None,
             prefill_chunk: int = 256, attention_backend: str | None = None,
             kv_cache_dtype=None, kv_commit: str | None = None) -> GenerationResult:
    """Generates up to `max_new_tokens` per prompt; greedy by default (arguments: this
    module's docstring)."""
    cfg = model.config
    rows, kv_dtype = _check_inputs(model, prompts, max_new_tokens,
                                   (temperature, top_k, top_p, min_p), kv_cache_dtype,
                                   page_size, prefill_chunk)
    mesh = shard.mesh_of(model.params)  # run where the params live (None: one device)
    speculator = _for_decoding(speculator, cfg, mesh, layer_layout)
    method = _verification(verification, speculator)
    cost = _cost_ratio(cost_ratio, speculator, cfg)
    # one seed per prompt: rows decide alone, so that a row's sampled tokens do not depend
    # on its batch; greedy tokens do not depend on the depth drafted
    per_row = temperature > 0 and not rng.is_seed(seed)
    if verify_cost is None and speculator is not None:
        verify_cost = default_verify_cost(cfg)
    rule = _rule(cost, adaptive, verify_cost, acceptance_prior, speculator, per_row, mesh,
                 step_overhead, proposal_prior, idle_overhead, probe_gap, prior_tries)
    depth = speculator.shape.max_depth if speculator is not None else 0
    lens = [len(r) for r in rows]
    with shard.use_mesh(mesh):  # the commit strategy depends on the mesh the loop runs on
        commit = commit_lib.resolve(kv_commit, attention_backend)
    # what the speculative program's first step reads: its page table, or the prompts
    first = attended_tokens(attention_backend, _Sizes.table_tokens(
        lens, max_new_tokens, prefill_chunk, page_size,
        _Sizes.page_slack(speculator, commit.write_in_verify)), lens, cfg.head_dim,
        kv_dtype if kv_dtype is not None else cfg.dtype)
    if speculator is not None and not may_draft(speculator, rule, len(rows), first):
        # the rule would keep every row at k = 0 with no probe: plain decoding's programs
        speculator, method = None, _verification(None, None)
        rule = _rule(0.0, adaptive, None, None, None, per_row, mesh, probe_gap=probe_gap)
    with shard.use_mesh(mesh):
        loop = DecodeLoop.create(cfg, speculator, backend=attention_backend, commit=commit,
                                 verification=method)
    sizes = _Sizes.of(lens, max_new_tokens, speculator, prefill_chunk,
                      page_size, num_pages, mesh, tree_in_cache=loop.commit.write_in_verify)
    prompt = _prompt(cfg, rows, sizes, seed, mesh, kv_dtype)
    sampling, max_new, eos_arr = shard.replicate(
        (sampling_lib.Sampling.create(temperature, top_k, top_p, min_p),
         jnp.int32(max_new_tokens),
         jnp.asarray(_stop_tokens(cfg, eos_id, ignore_eos), jnp.int32)), mesh)
    params = Params(target=model.decode_params(layer_layout),
                    speculator=speculator, sampling=sampling, max_new=max_new, eos_ids=eos_arr)

    t0 = time.perf_counter()
    chunks = dict(chunk=sizes.chunk, num_chunks=sizes.num_chunks, kv_dtype=kv_dtype)
    pre = PROGRAMS.get("prefill", DecodeLoop.prefill, loop.prefill_only(), (params, prompt),
                       chunks, mesh)
    params = params.replace(rule=rule)
    dec = PROGRAMS.get("run", DecodeLoop.run, loop, (params, pre.out_info), {}, mesh)
    compile_s = time.perf_counter() - t0
    state, ttft = _timed(pre, params.replace(rule=None), prompt)
    state, decode_s = _timed(dec, params, state)
    return _result(model, state, sizes.lens, cost, ttft, decode_s, compile_s, depth,
                   speculative=speculator is not None)


# ---------------------------------------------------------------------------- stages
def expected_gain(model: Model, speculator: Speculator, *, batch: int = 1,
                  context: int = 0, cost_ratio: float | None = None,
                  verify_cost: VerifyCost | None = None,
                  step_overhead: float | Sequence[float] | None = None,
                  idle_overhead: float | None = None,
                  acceptance_prior: Sequence[float | None] | None = None,
                  proposal_prior: float | None = None,
                  prior_tries: Sequence[float | None] | None = None) -> float:
    """What `generate`'s adaptive rule, given these arguments (as `generate` takes them),
    expects drafting with `speculator` to gain over plain decoding before a call's first
    step: expected tokens per unit of cost at the depth it would pick for a row of a
    `batch`-row call reading `context` cached tokens, over plain decoding's (1.0 where
    it would not draft; `policy.prior_gain`). The gain is read at the prior itself:
    prior_tries, checked as `generate` checks it, bounds only generate's choice to draft
    at all (`policy.may_draft`)."""
    if not isinstance(speculator, Speculator):
        raise ValueError(f"speculator={speculator!r} is not a specjax Speculator")
    if not (isinstance(batch, numbers.Integral) and batch >= 1):
        raise ValueError(f"batch={batch!r} must be an int >= 1")
    speculator.check_target(model.config)
    if verify_cost is None:
        verify_cost = default_verify_cost(model.config)
    rule = _rule(_cost_ratio(cost_ratio, speculator, model.config), True, verify_cost,
                 acceptance_prior, speculator, False, None, step_overhead, proposal_prior,
                 idle_overhead, prior_tries=prior_tries)
    return prior_gain(speculator, rule, batch, context)


def _check_inputs(model: Model, prompts, max_new_tokens, sampling: tuple, kv_cache_dtype,
                  page_size, prefill_chunk):
    """(prompts as token-id lists, the KV cache dtype), every argument checked."""
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    sampling_lib.validate_sampling(*sampling)  # temperature, top_k, top_p, min_p
    kv_dtype = kv_quant.check_kv_cache_dtype(kv_cache_dtype)
    if page_size < 1 or prefill_chunk < 1:
        raise ValueError(f"page_size={page_size} and prefill_chunk={prefill_chunk} must be >= 1")
    rows = as_token_lists(model, prompts)
    context = model.config.max_position_embeddings
    for i, ids in enumerate(rows):
        if len(ids) + max_new_tokens > context:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that "
                f"exceeds the model's context of {context} positions")
    return rows, kv_dtype


def _for_decoding(speculator: Speculator | None, cfg, mesh, layer_layout: str):
    """The speculator checked against the target and laid out for the loop."""
    if speculator is None:
        return None
    if not isinstance(speculator, Speculator):
        raise ValueError(f"speculator={speculator!r} is not a specjax Speculator")
    speculator.check_target(cfg)
    if mesh is not None:
        return shard.shard_speculator(speculator, mesh)
    return LAYOUTS.get(speculator, layer_layout)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# Chunk lengths above this are padded to a multiple of it: the decode buffer's own step
# (`round_up(..., 64)`), so prompt lengths add few compiled prefill programs beside the
# decode programs a length bucket already needs
PREFILL_MULTIPLE = 64


def prefill_chunks(max_len: int, prefill_chunk: int) -> tuple[int, int]:
    """(chunk, num_chunks) for prompts of up to `max_len` tokens: as few chunks of at most
    `prefill_chunk` tokens as cover them, of equal length padded to a power of two up to
    PREFILL_MULTIPLE and to a multiple of it beyond."""
    num_chunks = -(-max_len // prefill_chunk)
    need = -(-max_len // num_chunks)
    chunk = (1 << (need - 1).bit_length() if need <= PREFILL_MULTIPLE
             else round_up(need, PREFILL_MULTIPLE))
    return min(chunk, prefill_chunk), num_chunks


@dataclasses.dataclass(frozen=True)
class _Sizes:
    """The batch's buffers: prompt lengths, prefill chunking, token buffer width and the
    page pool with every row's pages."""

    lens: list[int]
    chunk: int
    num_chunks: int
    width: int
    pool: PagePool
    table: Any

    @staticmethod
    def bucketed(lens, max_new_tokens: int, prefill_chunk: int, extra: int) -> int:
        """The padded prompt chunks (and the token after them), or every row's prompt, new
        tokens and `extra`, in multiples of 64."""
        chunk, num_chunks = prefill_chunks(max(lens), prefill_chunk)
        return round_up(max(num_chunks * chunk + 1, max(lens) + max_new_tokens + extra), 64)

    @classmethod
    def table_tokens(cls, lens, max_new_tokens: int, prefill_chunk: int, page_size: int,
                     page_slack: int) -> int:
        """Tokens one row's page table holds (what the reference attention reads)."""
        pages = -(-cls.bucketed(lens, max_new_tokens, prefill_chunk, page_slack) // page_size)
        return pages * page_size

    @staticmethod
    def tree_slack(speculator) -> int:
        """Room past a row's budget for a verify's whole draft tree (one token without
        a speculator)."""
        return speculator.shape.num_nodes + 1 if speculator is not None else 1

    @classmethod
    def page_slack(cls, speculator, tree_in_cache: bool) -> int:
        """Pages' room past a row's budget: the tree's where the verify writes it there
        (`Commit.write_in_verify`), else one token. Attention reads every page of the
        table, so elsewhere a speculative program's plain steps cost what plain decoding's
        do, also when the tree's slack would cross a multiple of 64."""
        return cls.tree_slack(speculator) if tree_in_cache else 1

    @classmethod
    def of(cls, lens, max_new_tokens, speculator, prefill_chunk, page_size, num_pages, mesh,
           *, tree_in_cache: bool):
        """tree_in_cache: the verify forward writes the whole draft tree into the pages
        (`Commit.write_in_verify`), so they need its slack; otherwise only what is kept
        is written, never past a row's budget."""
        b = len(lens)
        chunk, num_chunks = prefill_chunks(max(lens), prefill_chunk)
        # the token buffer takes the tree's slack (the draft's too)
        width = cls.bucketed(lens, max_new_tokens, prefill_chunk, cls.tree_slack(speculator))
        page_slack = cls.page_slack(speculator, tree_in_cache)
        pages_per_row = cls.table_tokens(lens, max_new_tokens, prefill_chunk, page_size,
                                         page_slack) // page_size
        # Default pool: a full table per row, so the cache shape (and the compiled program)
        # depends only on the bucketed buffer width, not on the exact prompt lengths. On a
        # mesh each data shard owns the pages of its rows (shard-local ids).
        pool = PagePool(num_pages if num_pages is not None else b * pages_per_row, page_size,
                        num_shards=shard.page_shards(b, mesh))
        table = pool.allocate_rows([n + max_new_tokens + page_slack for n in lens],
                                   pages_per_row)
        return cls(list(lens), chunk, num_chunks, width, pool, table)


def _prompt(cfg, rows, sizes: _Sizes, seed, mesh, kv_dtype) -> Prompt:
    """The prefill input on the mesh: a zeroed cache and the padded prompts."""
    buf = np.zeros((len(rows), sizes.width), np.int32)
    for r, ids in enumerate(rows):
        buf[r, :len(ids)] = ids
    cache = shard.create_cache(cfg, sizes.table, num_pages=sizes.pool.num_pages,
                               page_size=sizes.pool.page_size, mesh=mesh, dtype=kv_dtype)
    return Prompt(cache=cache, tokens=shard.put(buf, mesh, ("batch", None), name="tokens"),
                  prompt_lens=shard.put(np.asarray(sizes.lens, np.int32), mesh, ("batch",),
                                        name="prompt_lens"),
                  keys=shard.put(rng.row_key_data(seed, len(rows)), mesh, ("batch", None),
                                 name="keys"))


def _stop_tokens(cfg, eos_id, ignore_eos: bool) -> list[int]:
    """The stop tokens, -1 padded to a multiple of 8 so that they never recompile."""
    if ignore_eos:
        eos = ()
    elif eos_id is None:
        eos = cfg.eos_ids
    else:
        eos = (eos_id,) if isinstance(eos_id, (int, np.integer)) else tuple(eos_id)
    return list(eos) + [-1] * (round_up(max(len(eos), 1), 8) - len(eos))


def _cost_ratio(cost_ratio, speculator: Speculator | None, cfg) -> float:
    if cost_ratio is not None and not (np.isfinite(cost_ratio) and cost_ratio >= 0):
        raise ValueError(f"cost_ratio={cost_ratio!r} must be a finite number >= 0")
    if speculator is None:
        return 0.0
    return float(speculator.cost.ratio(cfg) if cost_ratio is None else cost_ratio)


def _is_number(x) -> bool:
    """A real number, not a bool (True would otherwise pass as 1)."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _rule(cost: float, adaptive: bool, verify_cost, acceptance_prior, speculator,
          per_row: bool, mesh, step_overhead=None, proposal_prior=None, idle_overhead=None,
          probe_gap=None, prior_tries=None) -> Rule:
    """The adaptive rule's traced settings, replicated on the mesh."""
    if proposal_prior is not None and not (_is_number(proposal_prior)
                                           and 0 <= proposal_prior <= 1):
        raise ValueError(f"proposal_prior={proposal_prior!r} must be a rate in [0, 1] "
                         "(None: 1)")
    if idle_overhead is not None and not _is_cost(idle_overhead):
        raise ValueError(f"idle_overhead={idle_overhead!r} must be a finite number >= 0")
    max_depth = speculator.shape.max_depth if speculator is not None else 0
    if probe_gap is not None and not (isinstance(probe_gap, numbers.Integral)
                                      and not isinstance(probe_gap, (bool, np.bool_))
                                      and 1 <= probe_gap <= 2**24):
        raise ValueError(f"probe_gap={probe_gap!r} must be an int in [1, 2**24]")
    if verify_cost is not None and not isinstance(verify_cost, VerifyCost):
        raise ValueError(f"verify_cost={verify_cost!r} must be a specjax.VerifyCost")
    vcost = default_verify_cost() if verify_cost is None else verify_cost
    vcost = vcost.validated().canonical()  # one layout: another model compiles no loop
    prior = _prior(acceptance_prior, max_depth)
    return shard.replicate(Rule(jnp.float32(cost), jnp.bool_(adaptive),
                                jax.tree.map(jnp.float32, vcost), jnp.asarray(prior),
                                jnp.bool_(per_row),
                                jnp.asarray(_overhead(step_overhead, max_depth)),
                                proposal=jnp.float32(np.nan if proposal_prior is None
                                                     else proposal_prior),
                                idle=jnp.float32(idle_overhead or 0.0),
                                probe_gap=jnp.int32(PROBE_GAP if probe_gap is None
                                                    else probe_gap),
                                prior_tries=jnp.asarray(_tries(prior_tries, max_depth))), mesh)


def _timed(program, *args):
    """(program's output, its wall seconds), waiting for the token buffer."""
    t0 = time.perf_counter()
    state = program(*args)
    jax.block_until_ready(state.tokens)
    return state, time.perf_counter() - t0


def _result(model: Model, state, lens, cost, ttft, decode_s, compile_s,
            depth: int, speculative: bool) -> GenerationResult:
    """Generated tokens (and text) per row and the run's statistics, on the host; the
    acceptance counters span the speculator's `depth` even where the call ran plain
    (`speculative` False: plain decoding's programs ran)."""
    out_tokens, out_lens = shard.to_host(state.tokens), shard.to_host(state.lengths)
    gen = [out_tokens[r, lens[r]:out_lens[r]].tolist() for r in range(len(lens))]
    text = None
    if model.tokenizer is not None:
        text = [model.tokenizer.decode(g, skip_special_tokens=True) for g in gen]
    c = {f.name: shard.to_host(getattr(state.counters, f.name))
         for f in dataclasses.fields(state.counters)}
    pad = depth - c["tried"].shape[1]  # > 0 where the speculator never ran
    c["hist"] = np.pad(c["hist"], ((0, 0), (0, pad)))
    c["tried"] = np.pad(c["tried"], ((0, 0), (0, pad)))
    stats = build_stats(new_tokens=[len(g) for g in gen], **c, cost_ratio=cost,
                        ttft_s=ttft, decode_s=decode_s, compile_s=compile_s,
                        speculative_calls=int(speculative))
    return GenerationResult(gen, text, stats)


# ---------------------------------------------------------------------------- arguments
def as_token_lists(model: Model, prompts) -> list[list[int]]:
    """Prompts (one or a list; strings need `model.tokenizer`) as checked token-id lists."""
    if isinstance(prompts, (str, np.ndarray)) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or token-id lists")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise ValueError(f"prompt {i} is a string but the model has no tokenizer; "
                                 "pass token ids")
            p = model.tokenizer.encode(p).ids
        ids = [int(x) for x in np.asarray(p).reshape(-1)]
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        validate_tokens(np.asarray(ids), model.config.vocab_size, what=f"prompt {i} token")
        out.append(ids)
    return out


def _is_cost(value) -> bool:
    return _is_number(value) and bool(np.isfinite(value)) and value >= 0


def _overhead(step_overhead, max_depth: int) -> np.ndarray:
    """generate's `step_overhead` as `Rule.overhead`: [max_depth + 1] float32 by draft
    depth, entry 0 (a step that verifies nothing) as depth 1's. One shape whatever was
    given, so a call with it runs the same programs as one without."""
    if step_overhead is None or _is_cost(step_overhead):
        return np.full((max_depth + 1,), step_overhead or 0.0, np.float32)
    vals = list(step_overhead) if isinstance(step_overhead, (list, tuple, np.ndarray)) else []
    if max_depth == 0 or len(vals) != max_depth or not all(map(_is_cost, vals)):
        raise ValueError(f"step_overhead={step_overhead!r} must be a finite number >= 0 or "
                         f"max_depth={max_depth} of them, one per draft depth")
    return np.asarray(vals[:1] + vals, np.float32)


def _prior(acceptance_prior, max_depth: int) -> np.ndarray:
    """generate's `acceptance_prior` as the loop's [max_depth] float32 (NaN: default)."""
    return _per_depth("acceptance_prior", acceptance_prior, max_depth,
                      lambda a: 0 <= a <= 1, "rates in [0, 1] (None: the default)")


def _tries(prior_tries, max_depth: int) -> np.ndarray:
    """generate's `prior_tries` as `Rule.prior_tries`: [max_depth] float32 (NaN:
    unknown)."""
    return _per_depth("prior_tries", prior_tries, max_depth, lambda n: n >= 0,
                      "counts >= 0 (None: unknown)")


def _per_depth(name: str, values, max_depth: int, valid, what: str) -> np.ndarray:
    """A per-draft-depth argument as [max_depth] float32: NaN for None, NaN entries and
    the depths it does not list; each other entry a number passing `valid`, else a
    ValueError naming `name` and `what` it must list."""
    out = np.full((max_depth,), np.nan, np.float32)
    if values is None:
        return out
    vals = ([np.nan if v is None else v for v in values]
            if isinstance(values, (list, tuple, np.ndarray)) else None)
    if vals is None or len(vals) > max_depth or not all(
            _is_number(v) and (np.isnan(v) or valid(v)) for v in vals):
        raise ValueError(f"{name}={values!r} must list at most max_depth={max_depth} "
                         f"{what}")
    out[:len(vals)] = vals
    return out


def _verification(verification: str | None, speculator: Speculator | None) -> str:
    """generate's `verification` checked against the speculator (None: its own, or block
    verification for chains: lossless and never fewer tokens accepted in expectation)."""
    if verification is None:
        if speculator is None:
            return METHODS[0]
        own = speculator.verification
        return "block" if own == "rejection" and speculator.shape.proposes_chains else own
    if verification not in METHODS:
        raise ValueError(f"verification={verification!r} must be one of {METHODS}")
    if speculator is None:
        raise ValueError(f"verification={verification!r} needs a speculator")
    if verification == "block" and not speculator.shape.proposes_chains:
        raise ValueError(f"verification='block' verifies chains; {type(speculator).__name__} "
                         "proposes trees with siblings (use 'rejection')")
    return verification
