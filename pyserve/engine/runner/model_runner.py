"""Owns the model, the KV memory and the one thread that runs forward passes.

The asyncio loop must never wait on a forward pass, so every call into
torch for a step (forward + sampling) goes to a dedicated worker thread;
torch releases the GIL in its kernels. `launch` queues a step there and
returns at once; `wait` gives its results once they are on the host.

With --tp-size > 1 this is rank 0: it starts the other ranks (tp/workers.py)
and, on the forward thread, broadcasts each step's batch to them before
running its own shard of the same forward. Only rank 0 samples: the
sampler's state (per-request generators, penalty history, grammar
matchers) stays single-rank code, and the other ranks need no request
state at all, since the ids they read next arrive in the next batch.

The forward thread owns the sampler and each request's SamplingState:
`admit` and `release` hand them over through the thread's queue, which
runs in order, so a state is there for the first step that samples its
request and stays until the last step launched for it is done.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pyserve.engine.runner.profiler import StepProfiler
from pyserve.engine.runner.rank_model import RankModel
from pyserve.engine.runner.weight_swap import copy_weights, paired_tensors
from pyserve.engine.runner.weight_sync import Operation, WeightSync
from pyserve.engine.sampler import Sampler, token_logprobs, wants_logprobs
from pyserve.engine.sampling_state import SamplingState
from pyserve.engine.sequence import Sequence
from pyserve.engine.speculative import tree
from pyserve.engine.speculative.options import TargetGraphs
from pyserve.engine.speculative.overlap import StepRuns, follow_previous, resolve_placeholders
from pyserve.engine.speculative.rejection import EXACT, verify_drafts
from pyserve.engine.step import ScheduledStep
from pyserve.lora.adapter import Adapter
from pyserve.model.forward_batch import ForwardBatch
from pyserve.model.kv_buffer import SlotCopies
from pyserve.model.layers.causal_lm import AuxCapture
from pyserve.model.pooling import sum_spans
from pyserve.options import ModelOptions

logger = logging.getLogger("pyserve.engine")

@dataclass
class StepOutput:
    """A step's results on the host, once `ready` has fired: one sampled id
    per sampled sequence, and when any asked, their log-probabilities
    (sampler.token_logprobs: chosen [B], top values [B, K], top ids [B, K])."""

    ids: torch.Tensor  # int64
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    ready: "torch.cuda.Event | None"  # None: already complete
    # Prompt log-probabilities, in the same three parts, one row per target.
    prompt_logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Embedding requests: per step.embed_spans entry, the float32 sum of its
    # pooled rows' final-norm hidden states [spans, hidden].
    pooled: torch.Tensor | None = None
    # return_hidden_states: float32 [len(step.state_rows), hidden], those rows' final-norm hidden states.
    hidden_states: torch.Tensor | None = None
    # Sampled sequences whose grammar refused the token they sampled the
    # step before (a bug): the engine ends them.
    refused: list[Sequence] = field(default_factory=list)
    # Speculative steps: ids holds the token each logits row emits
    # (ScheduledStep.drafts; speculative/rejection.py), and counts how many
    # of each sequence's rows it emits (accepted drafts + the target's own token).
    counts: list[int] | None = None
    # Jump-forward: per sampled sequence, the tokens its grammar forced
    # after its last emitted one (Sampler.take_forced); None when none.
    forced: list[list[int]] | None = None
    # Per sampled sequence, the drafts its row verified where the forward
    # thread cut rows to the drafts it found (speculative/overlap.py); None:
    # ScheduledStep.drafts.
    drafted: list[int] | None = None

    def wait(self) -> None:
        """Blocks until the results are on the host; call it off the event loop."""
        if self.ready is not None:
            self.ready.synchronize()


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy that does not wait for the device: valid once an event
    recorded after it has fired."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class ModelRunner:
    def __init__(self, options: ModelOptions, model_dir: Path, graphs: TargetGraphs | None = None):
        """`options` resolved (ServerArgs.resolved): no "auto" left; `graphs`:
        what speculative decoding needs of the CUDA graphs."""
        torch.manual_seed(options.random_seed)
        self.ranks = None  # the other tensor-parallel ranks, when --tp-size > 1
        if options.tp_size > 1:
            from pyserve.engine.tp.workers import TensorParallelRanks

            self.ranks = TensorParallelRanks(options, model_dir)
        try:
            self.rank_model = self._start_rank_model(options, model_dir, graphs or TargetGraphs())
        except BaseException:
            if self.ranks is not None:
                self.ranks.abandon()
            raise
        self.sampler = Sampler(options.random_seed)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pyserve-forward")
        self.profiler = StepProfiler()  # /start_profile's, on the forward thread
        self.weight_sync = WeightSync(self.rank_model)  # a trainer's update groups, on the forward thread
        self.checkpoint_dir = model_dir  # whose weights are served: a memory release reads them again
        self._last_runs: StepRuns | None = None  # what the previous step emitted, for its following rows
        # --speculative-algorithm but NGRAM: its DraftModel or EagleDraft (speculative/options.py sets it).
        self.draft = None
        # How sampled requests keep drafts (--speculative-accept-threshold-*; speculative/options.py sets it).
        self.acceptance = EXACT
        kv_buffer = self.rank_model.kv_buffer
        capacity = (kv_buffer.num_pages - 1) * kv_buffer.page_size  # page 0 is never handed out
        logger.info(
            "KV cache: %d tokens in pages of %d (%.2f GiB%s), context length %d",
            capacity, kv_buffer.page_size, capacity * self.rank_model.kv_bytes_per_token() / (1 << 30),
            " on rank 0" if self.ranks else "", self.rank_model.context_len,
        )
        if kv_buffer.window_pages is not None:
            logger.info("KV cache of the %d sliding-window layers: %d tokens of their own",
                        len(kv_buffer.window_layers), (kv_buffer.window_pages - 1) * kv_buffer.page_size)

    def _start_rank_model(self, options: ModelOptions, model_dir: Path, graphs: TargetGraphs) -> RankModel:
        """Rank 0's model, with a KV cache of the size it decides for every rank."""
        if self.ranks is None:
            rank_model = RankModel(options, model_dir, torch.device(options.device))
            rank_model.allocate(rank_model.num_pages(), True, graphs.verify_tokens,
                                graphs.aux_layers(rank_model.config.num_hidden_layers))
            return rank_model
        ranks, member = self.ranks, self.ranks.member
        rank_model = RankModel(options, model_dir, member.device, member.tp, ranks.layout.ranks_per_node)
        aux_layers = graphs.aux_layers(rank_model.config.num_hidden_layers)
        num_pages = rank_model.num_pages()
        ranks.watched(ranks.channel.send_value, num_pages)
        # Capturing CUDA graphs runs collectives: every rank allocates at once.
        ranks.watched(rank_model.allocate, num_pages, True, graphs.verify_tokens, aux_layers)
        ranks.watched(ranks.channel.barrier)
        ranks.serving = True
        logger.info("Tensor parallelism: %d ranks over %d node(s) (%s), KV cache of %d pages on each",
                    options.tp_size, options.nnodes, ranks.layout.backend, num_pages)
        return rank_model

    @property
    def device(self) -> torch.device:
        return self.rank_model.device

    def forward(self, batch: ForwardBatch, capture: AuxCapture | None = None) -> torch.Tensor:
        """Float32 logits [B, vocab] for the rows in batch.logits_indices
        (`capture`: RankModel.forward's)."""
        return self.rank_model.forward(batch, capture)

    def admit(self, state: SamplingState) -> None:
        """Hand a request's sampling state to the forward thread; call from
        the event loop before the request is scheduled."""
        # Sampler.admit, not self.sampler.admit: even the method lookup on
        # the sampler belongs to the forward thread.
        self.executor.submit(Sampler.admit, self.sampler, state)

    def release(self, seq: Sequence) -> None:
        """Have the forward thread drop an ended request's sampling state
        once the steps launched so far are done; call from the event loop."""
        self.executor.submit(Sampler.release, self.sampler, seq)
        if self.draft is not None:
            self.executor.submit(type(self.draft).release, self.draft, seq)

    def load_lora(self, slot: int, adapter: Adapter, path: str) -> asyncio.Future:
        """Put an adapter's weights (read from `path`, a directory or a Hub
        id each rank finds in its node's cache) in `slot` on every
        rank, from the forward thread, between steps; call from the event
        loop with a slot no queued step reads."""
        def load() -> None:
            if self.ranks is not None:
                self.ranks.check()
                self.ranks.channel.send_adapter_load(slot, path)
            self.rank_model.lora.load(slot, adapter)

        return asyncio.get_running_loop().run_in_executor(self.executor, load)

    def swap_weights(self, model_dir: Path) -> asyncio.Future:
        """Read `model_dir`'s checkpoint and copy it into the served model's
        tensors (weight_swap.py) on every rank, on the forward thread after
        the steps queued so far; ValueError where it does not fit the served
        model, found on rank 0 before any rank copies."""
        def swap() -> None:
            pairs = paired_tensors(self.rank_model.model, self.rank_model.read_checkpoint(model_dir))
            if self.ranks is not None:
                self.ranks.check()
                self.ranks.channel.send_weight_swap(str(model_dir))  # each rank reads its own shard
            copy_weights(pairs)
            self.checkpoint_dir = model_dir

        return asyncio.get_running_loop().run_in_executor(self.executor, swap)

    @property
    def memory_released(self) -> frozenset[str]:
        """The memory tags released now (runner/memory_occupation.py); set on the forward thread."""
        return self.weight_sync.memory.released

    def sync_weights(self, op: Operation) -> asyncio.Future:
        """Every rank's Outcome of a weight sync operation (weight_sync.py),
        performed on the forward thread after the steps queued so far."""
        def sync() -> list:
            if self.ranks is None:
                return [self.weight_sync.perform(op)]
            self.ranks.check()
            self.ranks.channel.send_weight_sync(op)
            return self.ranks.channel.gather(self.weight_sync.perform(op))

        return asyncio.get_running_loop().run_in_executor(self.executor, sync)

    def launch(self, step: ScheduledStep) -> asyncio.Future:
        """Queue `step` on the worker thread; call from the event loop."""
        return asyncio.get_running_loop().run_in_executor(self.executor, self._counted_step, step)

    def _counted_step(self, step: ScheduledStep) -> StepOutput:
        try:
            return self.step(step)
        finally:
            self.profiler.on_step()

    def start_profile(self, **settings) -> asyncio.Future:
        """StepProfiler.start(**settings) on the forward thread, after the steps queued so far."""
        return asyncio.get_running_loop().run_in_executor(self.executor, lambda: self.profiler.start(**settings))

    def stop_profile(self) -> asyncio.Future:
        """The trace written (its path), on the forward thread."""
        return asyncio.get_running_loop().run_in_executor(self.executor, self.profiler.stop)

    @staticmethod
    async def wait(launched: asyncio.Future) -> StepOutput:
        """A launched step's results, once they are on the host."""
        output = await launched
        if output.ready is not None:
            await asyncio.to_thread(output.wait)
        return output

    def step(self, step: ScheduledStep) -> StepOutput:
        """Forward + sampling for one scheduled step; runs on the worker thread.

        Returns as soon as the work is queued on the device: on CUDA the ids
        come back through a non-blocking copy and an event, so this thread
        can launch the next step while this one computes. Decode rows whose
        input is a placeholder (-(row + 1), see step.py) read the last token
        sampled sequence `row` of the previous step emitted, still on the
        device; with drafts they move back over the previous step's
        rejected ones first (speculative/overlap.py). Logits rows past the
        sampled ones score the step's prompt targets.
        """
        seqs = step.sampled
        try:
            states = self.sampler.states_of(seqs)
            with torch.inference_mode():
                scheduled = step
                if step.following:
                    step = follow_previous(step, self._last_runs)
                drafted = None if step.drafts is scheduled.drafts else [len(d) for d in step.drafts]
                batch = step.batch.to(self.device)
                if step.following:
                    batch.input_ids = resolve_placeholders(batch.input_ids, self._last_runs)
                drafts, draft_probs, trees, capture = step.drafts, None, step.trees or None, None
                if self.draft is not None:
                    if drafts:
                        drafts, draft_probs, trees = self.draft.propose(step, batch, states, self.sampler)
                    capture = self.draft.capture()
                # Tree rows run as one row per token (speculative/tree.py).
                target_batch = batch if not trees else tree.expand(step, batch, trees)
                all_logits, pooled, hidden_states = self._forward_on_every_rank(target_batch, step, capture)
                num_rows = len(seqs) + sum(len(d) for d in step.drafts)
                logits = all_logits[:num_rows]
                if drafts:
                    next_ids, counts, forced, paths = verify_drafts(
                        logits, states, drafts, draft_probs, self.sampler, trees, self.acceptance)
                    if trees:
                        logits, copies, batch = tree.to_chain(step.batch, batch, logits, capture, drafts, paths)
                        if copies is not None:
                            self._copy_kv_on_every_rank(copies)
                else:
                    next_ids, counts = self.sampler.sample(logits, states), None
                    forced = self.sampler.take_forced()
                if self.draft is not None and (step.draft_rows is None or step.draft_rows):
                    self.draft.follow(step, batch, capture, next_ids, counts)
                refused = [s.seq for s in states if s.refused]
                logprobs = prompt_logprobs = None
                if any(wants_logprobs(s.params) for s in seqs):
                    logprobs = token_logprobs(logits, next_ids.to(logits.device),
                                              max(s.params.top_logprobs for s in seqs))
                if step.prompt_targets:
                    targets = torch.tensor(step.prompt_targets, device=self.device)
                    prompt_logprobs = token_logprobs(all_logits[num_rows:], targets, step.prompt_top_logprobs)
                self._last_runs = StepRuns.of(next_ids.to(self.device), drafts, counts, scheduled.drafts)
                if self.device.type != "cuda":
                    return StepOutput(next_ids.cpu(), logprobs, None, prompt_logprobs, pooled, hidden_states, refused,
                                      counts, forced, drafted)

                def to_host(parts):
                    return tuple(_pinned_copy(t) for t in parts) if parts is not None else None

                def one_to_host(t):
                    return _pinned_copy(t) if t is not None else None

                output = StepOutput(_pinned_copy(next_ids), to_host(logprobs), torch.cuda.Event(),
                                    to_host(prompt_logprobs), one_to_host(pooled), one_to_host(hidden_states),
                                    refused, counts, forced, drafted)
                output.ready.record()
                return output
        except Exception:
            self._last_runs = None  # a step that reads it now gets zeros, never an invalid index
            raise

    def _forward_on_every_rank(self, batch: ForwardBatch, step: ScheduledStep, capture: AuxCapture | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The step's logits (and pooled sums, and returned hidden states), the other tensor-parallel ranks
        given the same batch. `capture`: hidden states rank 0 keeps (the
        residual stream is whole on every rank)."""
        with self._on_every_rank("a tensor-parallel step") as channel:
            if channel is not None:
                channel.send(batch)
            return self._forward(batch, step, capture)

    def _copy_kv_on_every_rank(self, copies: SlotCopies) -> None:
        with self._on_every_rank("sending K/V copies to the tensor-parallel ranks") as channel:
            if channel is not None:
                channel.send_kv_copies(copies)
        self.rank_model.kv_buffer.copy_slots(copies)

    @contextmanager
    def _on_every_rank(self, what: str):
        """The other ranks' step channel (None on one rank) for a block that
        tells them what to do; a failure in the block fails every rank."""
        if self.ranks is None:
            yield None
            return
        self.ranks.check()
        try:
            yield self.ranks.channel
        except Exception as e:
            # The ranks may now be inside different collectives: none can go on.
            self.ranks.fail(f"{what} failed on rank 0: {e}")
            raise

    def _forward(self, batch: ForwardBatch, step: ScheduledStep, capture: AuxCapture | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Logits of the batch's logits rows and, for a step with embedding
        rows or hidden states to return, StepOutput.pooled and
        .hidden_states, in one pass through the layers (eager: no CUDA
        graph hands back other rows). The other ranks run a plain forward:
        the same collectives, since the extra rows' final norm is local and
        the vocabulary gather sees the same logits rows."""
        if not step.embed_rows and not step.state_rows:
            return self.forward(batch, capture), None, None
        wanted, pooled_rows = len(batch.logits_indices), len(step.embed_rows)
        rows = torch.cat([batch.logits_indices, torch.tensor(step.embed_rows + step.state_rows, device=self.device)])
        hidden = self.rank_model.hidden_states(batch, rows, capture)
        pooled = sum_spans(hidden[wanted : wanted + pooled_rows], [count for _, _, count in step.embed_spans]) \
            if step.embed_rows else None
        states = hidden[wanted + pooled_rows :].float() if step.state_rows else None
        return self.rank_model.model.logits(hidden[:wanted]), pooled, states

    def shutdown(self) -> None:
        """Stop the forward thread, then every other rank. RuntimeError when a
        rank had failed, so that the server exits with an error."""
        failure = self.ranks.failure if self.ranks is not None else None
        # After a failure the thread may be stuck in a collective that never ends.
        self.executor.shutdown(wait=failure is None, cancel_futures=True)
        if self.ranks is not None:
            self.ranks.stop()
            if self.ranks.failure is not None:
                raise RuntimeError(f"tensor parallelism failed: {self.ranks.failure}")
