"""The engine: requests in, streams of text deltas out.

`Engine.generate` queues a request and yields its outputs as the step loop
produces them. The step loop is one asyncio task: schedule (CPU) -> forward
and sample on the worker thread -> turn tokens into text -> hand outputs to
each request's queue. A caller that stops listening aborts its request,
which gives back every KV slot at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import torch

from pyserve._rust import Tokenizer
from pyserve.engine.metrics import EngineMetrics
from pyserve.engine.model_runner import ModelRunner, StepOutput
from pyserve.engine.output_processor import OutputProcessor
from pyserve.engine.radix_cache import RadixCache
from pyserve.engine.request import GenerateOutput, GenerateRequest, RequestError, TokenLogprob
from pyserve.engine.sampler import reads_history, wants_logprobs
from pyserve.engine.scheduler import ScheduledStep, Scheduler
from pyserve.engine.sequence import Sequence
from pyserve.server_args import ServerArgs

logger = logging.getLogger("pyserve.engine")
_IDLE_CHECK_INTERVAL = 1.0  # seconds


def _entries(parts: tuple[torch.Tensor, ...], token_ids: list[int], ks: list[int]) -> list[TokenLogprob]:
    """TokenLogprob per row of token_logprobs' (chosen, top values, top ids),
    row i keeping its first ks[i] alternatives."""
    chosen, top_vals, top_ids = (t.tolist() for t in parts)
    return [TokenLogprob(t, chosen[i], list(zip(top_ids[i][:k], top_vals[i][:k])))
            for i, (t, k) in enumerate(zip(token_ids, ks))]


def _token_logprobs(output: StepOutput, seqs: list[Sequence], ids: list[int]) -> list[TokenLogprob | None]:
    """Per sampled sequence, its token's logprob entry if it asked for one."""
    if output.logprobs is None:
        return [None] * len(ids)
    entries = _entries(output.logprobs, ids, [s.params.top_logprobs for s in seqs])
    return [e if wants_logprobs(s.params) else None for s, e in zip(seqs, entries)]


def _prompt_logprobs(output: StepOutput, step: ScheduledStep) -> list[tuple[Sequence, list[TokenLogprob]]]:
    """The step's prompt log-probabilities, split by sequence."""
    if output.prompt_logprobs is None:
        return []
    ks = [seq.params.top_logprobs for seq, count in step.prompt_spans for _ in range(count)]
    entries = _entries(output.prompt_logprobs, step.prompt_targets, ks)
    out, row = [], 0
    for seq, count in step.prompt_spans:
        out.append((seq, entries[row : row + count]))
        row += count
    return out


class Engine:
    def __init__(self, args: ServerArgs):
        if args.model_path:
            self.model_dir = Path(args.model_path)
        else:
            from pyserve.default_model import default_model_path

            self.model_dir = default_model_path()
        self.args = args
        self.tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self.runner = ModelRunner(args, self.model_dir)
        self.model_config = self.runner.config
        self.context_len = self.runner.context_len
        self.eos_token_ids = self.model_config.eos_token_ids
        # Ids the model can produce or read: the embedding rows.
        self.vocab_size = self.model_config.vocab_size
        cache = None if args.disable_radix_cache else RadixCache(self.runner.kv_pool)
        self.scheduler = Scheduler(
            self.runner.kv_pool, cache, args.max_running_requests, args.max_prefill_tokens,
            args.chunked_prefill_size if args.chunked_prefill_size > 0 else None,
        )
        self._processors: dict[str, OutputProcessor] = {}
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._decode_steps = 0
        self._decode_tokens = 0
        self._decode_log_start = time.perf_counter()
        self._last_idle_check = -float("inf")
        self.metrics = EngineMetrics()
        overlap_off = args.disable_overlap_schedule
        self.overlap = self.runner.device.type == "cuda" if overlap_off is None else not overlap_off

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.create_task(self._step_loop(), name="pyserve-engine")

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        for rid in list(self._processors):
            self.abort(rid)
        self.runner.shutdown()

    # -- requests ------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def validate(self, req: GenerateRequest) -> None:
        """Raise RequestError for a request the engine cannot run. The one
        place these checks live: the API asks here before it answers."""
        n = len(req.input_ids)
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        bad = next((i for i in req.input_ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise RequestError(f"token id {bad} is outside the vocabulary (size {self.vocab_size})", "prompt")
        max_new = req.params.max_new_tokens
        if max_new is not None and max_new < 1:
            raise RequestError("max_new_tokens must be at least 1", "max_new_tokens")
        if n >= self.context_len or (max_new is not None and n + max_new > self.context_len):
            # vLLM's wording, which clients already know how to read.
            asked = max_new or 0
            raise RequestError(
                f"This model's maximum context length is {self.context_len} tokens. However, you requested "
                f"{n + asked} tokens ({n} in the prompt, {asked} in the completion). "
                "Please reduce the length of the messages or completion.",
                "prompt" if n >= self.context_len else "max_new_tokens", "context_length_exceeded",
            )
        capacity = self.runner.kv_pool.capacity_tokens
        if n + 1 > capacity:
            raise RequestError(f"the prompt has {n} tokens, but the KV cache holds {capacity}", "prompt")

    def _max_new_tokens(self, req: GenerateRequest) -> int:
        """What the request may generate: its own limit, or the server's
        default, never past the context."""
        wanted = req.params.max_new_tokens or self.args.default_max_tokens or self.context_len
        return min(wanted, self.context_len - len(req.input_ids))

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Yields output deltas; the last one has finished=True."""
        self.validate(req)
        if self._loop_task is None:
            raise RuntimeError("the engine is not started")
        if req.rid in self._processors:
            raise RequestError(f"request id {req.rid} is already running", "rid")
        params = replace(req.params, max_new_tokens=self._max_new_tokens(req))
        seq = Sequence(rid=req.rid, prompt_ids=list(req.input_ids), params=params, priority=req.priority,
                       arrival=time.monotonic())
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed)
        self._processors[seq.rid] = OutputProcessor(seq, self.tokenizer, self.eos_token_ids, self.context_len)
        self.scheduler.add(seq)
        self._wakeup.set()
        try:
            while True:
                out = await seq.outputs.get()
                yield out
                if out.finished:
                    return
        finally:
            if not seq.finished:
                self.abort(seq.rid)

    def abort(self, rid: str) -> None:
        """Stop a request now and give back everything it holds."""
        proc = self._processors.pop(rid, None)
        if proc is None:
            return
        seq = proc.seq
        seq.aborted = seq.finished = True
        self.scheduler.release(seq)
        last = proc.abort()
        self._record_finish(seq, last)
        seq.outputs.put_nowait(last)

    # -- the step loop -------------------------------------------------------

    async def _step_loop(self) -> None:
        """Schedule, launch, then finish the previous step while this one runs.

        With overlap (the default) the loop schedules and launches step N+1
        before it turns step N's ids into text, so the device never waits
        for the CPU work in between. Without it, each step is finished
        before the next is scheduled.
        """
        loop = asyncio.get_running_loop()
        in_flight: tuple[ScheduledStep, asyncio.Future] | None = None
        try:
            while True:
                if in_flight is not None and self._needs_known_tokens():
                    await self._complete(*in_flight)
                    in_flight = None
                step = self.scheduler.schedule()
                if step is None:
                    if in_flight is not None:  # its results may free room or finish requests
                        await self._complete(*in_flight)
                        in_flight = None
                    elif self.scheduler.holders():
                        self._unstick()
                    else:
                        self._check_when_idle()
                        self._wakeup.clear()
                        await self._wakeup.wait()
                    continue
                self._log_step(step)
                prompt_top = max((seq.params.top_logprobs for seq, _ in step.prompt_spans), default=0)
                launched = loop.run_in_executor(
                    self.runner.executor, self.runner.step, step.batch, step.sampled, step.has_placeholders,
                    step.prompt_targets, prompt_top,
                )
                for row, seq in enumerate(step.sampled):
                    seq.pending += 1
                    seq.pending_row = row
                if in_flight is not None:
                    await self._complete(*in_flight)
                in_flight = (step, launched)
                if not self.overlap:
                    await self._complete(*in_flight)
                    in_flight = None
        except BaseException:
            # Whatever stopped the loop (shutdown or a bug), no caller is left
            # waiting forever.
            for rid in list(self._processors):
                self.abort(rid)
            raise

    def _needs_known_tokens(self) -> bool:
        """Penalties read every previous token when sampling: such a
        sequence's next step waits for its pending token to come back."""
        return any(reads_history(s.params) for s in self.scheduler.running)

    def _unstick(self) -> None:
        """Sequences hold pages yet none can advance: make one wait, or end
        the lone one that cannot grow even with the whole pool."""
        if not self.scheduler.retract_one():
            for seq in self.scheduler.holders():
                self._finish(seq, self._processors[seq.rid].out_of_memory())

    async def _complete(self, step: ScheduledStep, launched: asyncio.Future) -> None:
        """Wait for a launched step's ids and hand them to their requests."""
        try:
            output = await launched
            if output.ready is not None:
                await asyncio.to_thread(output.wait)
            next_ids = output.ids.tolist()
            logprobs = _token_logprobs(output, step.sampled, next_ids)
            prompt_logprobs = _prompt_logprobs(output, step)
        except Exception:
            # What it wrote may be garbage, and prompts go into the prefix
            # cache as soon as they are scheduled: end every request holding
            # KV and drop the cache, rather than let anyone read bad KV.
            logger.exception("forward pass failed; aborting the running requests and dropping the prefix cache")
            for seq in step.seqs + self.scheduler.holders():
                seq.kv_valid = False
                self.abort(seq.rid)
            if self.scheduler.cache is not None:
                self.scheduler.cache.evict(self.scheduler.cache.total_pages)
            return
        for seq, entries in prompt_logprobs:
            if not seq.finished:
                self._processors[seq.rid].add_prompt_logprobs(entries)
        for seq, token_id, logprob in zip(step.sampled, next_ids, logprobs):
            seq.pending -= 1
            if seq.finished:  # aborted, or finished by an earlier token, while this step ran
                continue
            if seq.first_token_at is None:
                seq.first_token_at = time.monotonic()
                self.metrics.on_first_token(seq.first_token_at - seq.arrival)
            out = self._processors[seq.rid].append(token_id, logprob)
            if out.finished:
                self._finish(seq, out)
            else:
                seq.outputs.put_nowait(out)
        if not step.is_prefill:
            self._decode_steps += 1
            self._decode_tokens += len(step.seqs)

    def _finish(self, seq: Sequence, last: GenerateOutput) -> None:
        seq.finished = True
        self._processors.pop(seq.rid)
        self.scheduler.release(seq)
        self._record_finish(seq, last)
        seq.outputs.put_nowait(last)

    def _record_finish(self, seq: Sequence, last: GenerateOutput) -> None:
        ttft = None if seq.first_token_at is None else seq.first_token_at - seq.arrival
        self.metrics.on_finish(last.finish_reason, len(seq.prompt_ids), seq.cached_tokens or 0,
                               len(seq.output_ids), time.monotonic() - seq.arrival, ttft)

    def _log_step(self, step: ScheduledStep) -> None:
        s = self.scheduler
        if step.is_prefill:
            logger.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                "#running-req: %d, #queue-req: %d",
                step.num_prefill_seqs, step.num_prefill_tokens, step.num_cached_tokens, s.token_usage(),
                len(step.seqs) - step.num_prefill_seqs, len(s.waiting),
            )
        elif self._decode_steps % self.args.decode_log_interval == 0 and self._decode_steps:
            now = time.perf_counter()
            throughput = self._decode_tokens / max(now - self._decode_log_start, 1e-9)
            logger.info(
                "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                "gen throughput (token/s): %.2f, #queue-req: %d",
                len(s.running), s.owned_tokens(), s.token_usage(), throughput, len(s.waiting),
            )
            self._decode_tokens = 0
            self._decode_log_start = now

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests run."""
        s = self.scheduler
        if s.holders() or s.waiting:
            return False
        if s.cache is not None:
            s.cache.evict(s.cache.total_pages)
        return True

    def kv_usage(self) -> dict[str, int]:
        """KV cache tokens by owner, in whole pages. When idle, in_use is 0
        and every cached token can be evicted."""
        s, pool = self.scheduler, self.runner.kv_pool
        ps = pool.page_size
        return {
            "total": pool.capacity_tokens,
            "free": pool.num_free * ps,
            "in_use": s.owned_pages() * ps,
            "cached": s.cached_pages() * ps,
            "cached_evictable": (s.cache.evictable_pages() if s.cache is not None else 0) * ps,
            "page_size": ps,
        }

    def integrity_problem(self) -> str | None:
        """None when every KV page is exactly one of: free, owned by the
        prefix cache, or held by one running sequence (nothing leaked,
        nothing shared by mistake); else what is wrong. Valid at any time
        between steps."""
        pool, s = self.runner.kv_pool, self.scheduler
        owners = [pool.free_page_ids()]
        if s.cache is not None:
            owners.append(pool.pages_of(s.cache.all_slots()))
        owners += [pool.pages_of(seq.slots[seq.num_shared :]) for seq in s.holders()]
        counts = torch.bincount(torch.cat(owners), minlength=pool.num_pages)
        counts[0] += 1  # the reserved padding page
        if bool((counts == 1).all()):
            return None
        lost = (counts == 0).nonzero().flatten().tolist()
        doubled = (counts > 1).nonzero().flatten().tolist()
        return f"KV pages leaked: {lost[:10]} (of {len(lost)}); held twice: {doubled[:10]} (of {len(doubled)})"

    def _check_when_idle(self) -> None:
        """With nothing running, every page must be free or cached: a leak
        shows here first. At most once a second, so a server answering one
        request at a time does not pay for it on every request."""
        now = time.monotonic()
        if now - self._last_idle_check < _IDLE_CHECK_INTERVAL:
            return
        self._last_idle_check = now
        problem = self.integrity_problem()
        if problem is not None:
            logger.error("KV cache integrity check failed while idle: %s", problem)

    def check_integrity(self) -> None:
        problem = self.integrity_problem()
        if problem is not None:
            raise AssertionError(problem)
