"""The engine: requests in, streams of text deltas out.

`Engine.generate` queues a request and yields its outputs as the step loop
produces them. The step loop is one asyncio task: schedule (CPU) -> forward
and sample on the worker thread -> turn tokens into text -> hand outputs to
each request's channel. A caller that stops listening aborts its request,
which gives back every KV slot at once.

A request has three records, each with one owner: its Sequence (scheduling, KV, tokens) and its output side
(text, stops, logprobs; the engine's `_outputs`), both on the event loop, and its SamplingState (generator,
grammar matcher, penalty history), which the engine builds and hands to the forward thread, which alone touches
it until it drops it (ModelRunner.admit / release). A constrained request's grammar is compiled off the loop
(engine/grammar.py) before the request is queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import torch

from pyserve._rust import Tokenizer
from pyserve.engine.adapters import Adapters, adapter_of
from pyserve.engine.admission import GRAMMARS_OFF, ServedFields, check_fields, check_prompt, check_queue
from pyserve.engine.embedding import EmbeddingOutput, embedding_mismatch
from pyserve.engine.grammar import GrammarBackend, tokenizer_info
from pyserve.engine.jump_forward import emitted_tokens
from pyserve.engine.kv.manager import KVManager
from pyserve.engine.metrics import EngineMetrics
from pyserve.engine.runner.model_runner import ModelRunner
from pyserve.engine.output_processor import OutputProcessor, hidden_states, prompt_logprobs, sampled_logprobs
from pyserve.engine.kv.window_pages import page_allocator
from pyserve.engine.request import Constraint, GenerateOutput, GenerateRequest, RequestError, TokenLogprob
from pyserve.engine import watchdog
from pyserve.engine.request_log import RequestLog
from pyserve.engine.sampling_state import SamplingState
from pyserve.engine.schedule_policy import WaitingOrder
from pyserve.engine.scheduler import Scheduler
from pyserve.engine.sequence import Sequence
from pyserve.engine.speculative.commit import row_sequences
from pyserve.engine.speculative.corpora import ExternalCorpora
from pyserve.engine.speculative.ngram import NgramTreeDrafter
from pyserve.engine.speculative.options import drafter_of, target_graphs
from pyserve.engine.step import ScheduledStep
from pyserve.engine.step_log import StepLog
from pyserve.model.config import ModelConfig
from pyserve.model.pooling import PoolingConfig
from pyserve.options import EngineOptions, ModelOptions
from pyserve.server_args import ServerArgs

logger = logging.getLogger("pyserve.engine")


class Engine:
    def __init__(self, options: EngineOptions, model_options: ModelOptions):
        """The engine's and the model's options, resolved (ServerArgs.resolved); the model's go to the runner."""
        if model_options.model_path:
            self.model_dir = Path(model_options.model_path)
        else:
            from pyserve.model.default_model import default_model_path

            self.model_dir = default_model_path()
        # --tokenizer-path: the tokenizer and chat template served, where not the model's own.
        self.tokenizer_dir = Path(model_options.tokenizer_path) if model_options.tokenizer_path else self.model_dir
        # --skip-tokenizer-init: token ids in and out, no text.
        self.tokenizer = None if model_options.skip_tokenizer_init else \
            Tokenizer.from_file(str(self.tokenizer_dir / "tokenizer.json"))
        self.runner = ModelRunner(model_options, self.model_dir, target_graphs(options, model_options))
        # The loaded model's facts: its context, and its vocabulary (the embedding rows: ids it reads or makes).
        self.model_config: ModelConfig = self.runner.rank_model.config
        self.context_len: int = self.runner.rank_model.context_len
        self.eos_token_ids, self.vocab_size = self.model_config.eos_token_ids, self.model_config.vocab_size
        self.default_max_tokens, self.watchdog_timeout = options.default_max_tokens, options.watchdog_timeout
        self.max_queued_requests, self.stream_interval = options.max_queued_requests, options.stream_interval
        self.grammars = None  # --grammar-backend none: constrained requests are refused
        # --is-embedding: how prompts become vectors; None on a generation server.
        self.pooling = PoolingConfig.from_dir(self.model_dir, self.model_config.hidden_size) \
            if model_options.is_embedding else None
        if options.grammar_backend == "xgrammar" and self.pooling is None and self.tokenizer is not None:
            info = tokenizer_info(self.tokenizer, (self.tokenizer_dir / "tokenizer.json").read_text(),
                                  self.vocab_size, self.eos_token_ids)
            self.grammars = GrammarBackend(info, None if options.disable_jump_forward else self.tokenizer)
        causal = self.model_config.causal  # an encoder computes prompts whole: no cached prefix, no chunks
        self.kv = KVManager(page_allocator(self.runner.rank_model.kv_buffer, self.model_config.sliding_window),
                            use_radix_cache=causal and not options.disable_radix_cache)
        chunk = self.kv.fit_chunk(options.chunked_prefill_size if causal and options.chunked_prefill_size > 0 else None)
        self.prompt_capacity = self.kv.prompt_capacity(chunk)
        # None unless --speculative-algorithm; STANDALONE's draft model goes to the runner.
        self.drafter = drafter_of(options, model_options, self.model_dir, self.runner, self.tokenizer, self.tokenizer_dir)
        self.scheduler = Scheduler(self.kv, options.max_running_requests, options.max_prefill_tokens, chunk,
                                   priority_scheduling=options.enable_priority_scheduling, drafter=self.drafter)
        self.scheduler.jump_forward = self.grammars is not None and self.grammars.jump_tokenizer is not None
        self.served = ServedFields.of(options, self.model_config, self.pooling is not None)
        self.scheduler.order = WaitingOrder(options.schedule_policy, self.kv, model_options.random_seed)
        self.metrics = EngineMetrics()
        self.request_log = RequestLog(options.log_requests, options.log_requests_level, self.tokenizer)
        # Each request's output side, by its sequence, while it runs.
        self._outputs: dict[Sequence, OutputProcessor | EmbeddingOutput] = {}
        self._step_log = StepLog(self.scheduler, self.kv, options.decode_log_interval, self.metrics)
        self._wakeup = asyncio.Event()
        self._stopped_stepping = asyncio.Event()  # set while paused, once no step is in flight
        self._loop_task: asyncio.Task | None = None
        self.overlap = not options.disable_overlap_schedule
        # --enable-lora: the adapters requests pick by name; None: the base model alone.
        self.adapters = Adapters(model_options, self.runner, self.scheduler.requests.values) \
            if model_options.enable_lora else None

    @classmethod
    def from_args(cls, args: ServerArgs) -> Engine:
        """The engine `pyserve` would run with `args`, resolved: a script's or a test's way in."""
        options = args.resolved().split()
        return cls(options.engine, options.model)

    # -- lifecycle -----------------------------------------------------------

    async def start(self) -> None:
        if self.adapters is not None:
            await self.adapters.load_initial()
        if self._loop_task is None:
            self._wakeup = asyncio.Event()
            self._loop_task = asyncio.create_task(self._step_loop(), name="pyserve-engine")

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        self.abort_all("error")
        self.runner.shutdown()
        if self.grammars is not None:
            self.grammars.shutdown()

    # -- requests ------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.holders())

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def max_running_requests(self) -> int:
        return self.scheduler.max_running

    def validate(self, req: GenerateRequest) -> None:
        """Raise RequestError for a request the engine cannot run. The one place these checks live: the API
        asks here before it answers."""
        check_prompt(req, self.vocab_size, self.context_len, self.prompt_capacity)
        check_fields(req, self.grammars is not None, self.scheduler.priority_scheduling, self.tokenizer is not None,
                     self.served)
        if req.embedding != (self.pooling is not None):
            raise RequestError(embedding_mismatch(req.embedding), "prompt")
        adapter_of(req, self.adapters)

    def check_queue_room(self) -> None:
        """RequestError (code "queue_full") while --max-queued-requests
        interactive sequences wait: an API request asks once, before any of
        its sequences enters, and is taken or refused whole."""
        check_queue(self.scheduler.waiting, self.max_queued_requests)

    async def compile_grammar(self, constraint: Constraint) -> None:
        """Compile (or find cached) a constraint's grammar; RequestError
        (field "constraint") with the compiler's message when it cannot be.
        Callers that must answer before streaming call this first; generate
        does it too."""
        if self.grammars is None:
            raise RequestError(GRAMMARS_OFF, "constraint")
        await self.grammars.compile(constraint)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Yields output deltas; the last one has finished=True."""
        self.validate(req)
        if self._loop_task is None:
            raise RuntimeError("the engine is not started")
        if req.rid in self.scheduler.requests:
            raise RequestError(f"request id {req.rid} is already running", "rid")
        # What the request may generate: its own limit or the server's default, within the context.
        wanted = req.params.max_new_tokens or self.default_max_tokens or self.context_len
        params = replace(req.params, max_new_tokens=min(wanted, self.context_len - len(req.input_ids)),
                         pooling=self.pooling.mode if req.embedding else None)
        seq = Sequence(rid=req.rid, prompt_ids=list(req.input_ids), params=params, batch=req.batch,
                       priority=req.priority or 0, cache_salt=req.cache_salt, arrival=time.monotonic(),
                       lora=adapter_of(req, self.adapters), prompt_embeds=req.prompt_embeds)
        if params.pooling:
            self._outputs[seq] = EmbeddingOutput(seq, self.pooling)
        else:
            output = OutputProcessor(seq, self.tokenizer, self.eos_token_ids, self.context_len,
                                     speculative=self.drafter is not None, stream_interval=self.stream_interval)
            constraint = params.constraint
            grammar = constraint and self.grammars.new_state(await self.grammars.compile(constraint), constraint.after)
            generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
            self.runner.admit(SamplingState(seq, generator, grammar, frozenset(output.stop_ids)))
            self._outputs[seq] = output
        self.scheduler.add(seq)
        self.request_log.received(seq)
        self._wakeup.set()
        try:
            while True:
                out = await seq.channel.get()
                yield out
                if out.finished:
                    return
        finally:
            if not seq.finished:
                self.abort(seq.rid)

    def abort(self, rid: str, reason: str = "abort") -> None:
        """Stop a request now, freeing what it holds: "abort" (a client asked), "error" (the server cannot go on)."""
        seq = self.scheduler.requests.get(rid)
        if seq is not None:
            self._finish(seq, self._outputs[seq].abort(reason))

    @property
    def request_ids(self) -> list[str]:
        """The requests in the engine now, waiting or running."""
        return list(self.scheduler.requests)

    def abort_all(self, reason: str = "abort") -> None:
        for rid in self.request_ids:
            self.abort(rid, reason)

    async def pause(self, retract: bool) -> None:
        """No step after the one in flight until resume(); `retract`: running requests give their KV back."""
        self._stopped_stepping.clear()
        self.scheduler.pause(retract)
        self._wakeup.set()
        await self._stopped_stepping.wait()

    def resume(self) -> None:
        self.scheduler.paused = False
        self._stopped_stepping.set()  # a pause() still waiting returns
        self._wakeup.set()

    # -- the step loop -------------------------------------------------------

    async def _step_loop(self) -> None:
        """Schedule, launch, then finish the previous step while this one runs. With overlap the loop
        schedules and launches step N+1 before it turns step N's ids into text, so the device never waits
        for the CPU work in between; without it, each step is finished before the next is scheduled."""
        in_flight: tuple[ScheduledStep, asyncio.Future] | None = None
        try:
            while True:
                if in_flight is not None and (not self.overlap or self.scheduler.needs_known_tokens()):
                    await self._process(in_flight)
                    in_flight = None
                step = self.scheduler.schedule()
                if step is None:
                    if in_flight is not None:  # its results may free room or finish requests
                        await self._process(in_flight)
                        in_flight = None
                    else:
                        await self._idle()
                    continue
                self._step_log.on_launch(step)
                launched = (step, self.runner.launch(step))
                self.scheduler.on_launched(step)
                if in_flight is not None:
                    await self._process(in_flight)
                in_flight = launched
        except BaseException:
            # Whatever stopped the loop (shutdown or a bug), no caller is left
            # waiting forever.
            self.abort_all("error")
            raise

    async def _idle(self) -> None:
        """Nothing to schedule: settle a pause; make one sequence that holds
        pages but cannot advance wait, or end the lone one that cannot grow
        even with the whole pool; or wait for a request."""
        if self.scheduler.paused:
            self.scheduler.settle_pause()
            self._stopped_stepping.set()
        elif self.scheduler.holders():
            if not self.scheduler.retract_one():
                for seq in self.scheduler.holders():
                    self._finish(seq, self._outputs[seq].out_of_memory())
            return
        else:
            self.kv.check_when_idle()
        self._wakeup.clear()
        await self._wakeup.wait()

    async def _process(self, in_flight: tuple[ScheduledStep, asyncio.Future]) -> None:
        """Wait for a launched step's ids and hand them to their requests."""
        step, launched = in_flight
        try:
            output = await watchdog.within(self.runner.wait(launched), self.watchdog_timeout)
            next_ids = output.ids.tolist()
            logprobs = sampled_logprobs(output, row_sequences(step, output.drafted), next_ids)
            prompt, states = prompt_logprobs(output, step), hidden_states(output, step)
        except Exception:
            self._on_failed_step(step)
            return
        finally:
            self.scheduler.on_results(step)
        for seq in output.refused:
            if not seq.finished:
                self._finish(seq, self._outputs[seq].abort("error"))
        for seq, entries in prompt:
            if not seq.finished:
                self._outputs[seq].add_prompt_logprobs(entries)
        for seq, rows in states:
            if not seq.finished:
                self._outputs[seq].add_hidden_states(rows)
        for seq, token_ids, entries in emitted_tokens(step, output, next_ids, logprobs, self.kv, self.drafter,
                                                      self.metrics):
            self._on_token(seq, token_ids, entries)
        for (seq, start, count), total in zip(step.embed_spans, [] if output.pooled is None else output.pooled):
            if not seq.finished:
                self._outputs[seq].add(start, count, total)
        for seq in step.embedded:
            if not seq.finished:
                self._finish(seq, self._outputs[seq].finish())
        self._step_log.on_done(step)
        self.metrics.on_step(step.batch.input_ids.numel())

    def _on_failed_step(self, step: ScheduledStep) -> None:
        """What the step wrote may be garbage, and prompts go into the prefix
        cache as soon as they are scheduled: end every request holding KV
        and drop the cache, rather than let anyone read bad KV."""
        logger.exception("forward pass failed; aborting the running requests and dropping the prefix cache")
        for seq in step.seqs + self.scheduler.holders():
            seq.kv_valid = False
            self.abort(seq.rid, "error")
        self.kv.evict_all()

    def _on_token(self, seq: Sequence, token_ids: list[int], logprobs: list[TokenLogprob | None]) -> None:
        """A step's tokens for `seq`, handed out as one output."""
        if seq.first_token_at is None:
            seq.first_token_at = time.monotonic()
            self.metrics.on_first_token(seq.first_token_at - seq.arrival)
        out = self._outputs[seq].extend(token_ids, logprobs)
        if out is None:  # held back, --stream-interval
            return
        if out.finished:
            self._finish(seq, out)
        else:
            seq.channel.put_nowait(out)

    def _finish(self, seq: Sequence, last: GenerateOutput) -> None:
        seq.finished = True
        self.scheduler.remove(seq)
        del self._outputs[seq]
        if not seq.params.pooling:
            self.runner.release(seq)
        ttft = None if seq.first_token_at is None else seq.first_token_at - seq.arrival
        self.metrics.on_finish(last.finish_reason, len(seq.prompt_ids), seq.cache_hit or 0,
                               len(seq.output_ids), time.monotonic() - seq.arrival, ttft)
        self.request_log.finished(seq, last)
        seq.channel.put_nowait(last)

    # -- figures -------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Drop every cached prefix, and what the drafter learned from
        requests; refused (False) while requests hold KV."""
        if self.scheduler.holders():
            return False
        self.kv.evict_all()
        if self.drafter is not None:
            self.drafter.forget()
        return True

    def kv_usage(self) -> dict[str, int]:
        """KV cache tokens: total, free, in_use (held by running requests),
        cached and cached_evictable (prefix cache), page_size."""
        return self.kv.usage(self.scheduler.holders())

    def token_usage(self) -> float:
        """Share of the KV cache that running requests need (0 when idle)."""
        return self.kv.token_usage()

    @property
    def external_corpora(self) -> ExternalCorpora | None:
        """NGRAM trees' corpora; None where no NGRAM trees are drafted."""
        return self.drafter.corpora if isinstance(self.drafter, NgramTreeDrafter) else None

    def internal_state(self) -> dict[str, float]:
        """What SGLang's /get_server_info reports of a scheduler
        (`internal_states`): the last decode line's generation throughput
        and, with speculation on, the mean tokens a verify step emitted."""
        state = {"last_gen_throughput": self._step_log.last_gen_throughput}
        if self.drafter is not None:
            state["avg_spec_accept_length"] = self.metrics.accept_length()
        return state

    def integrity_problem(self) -> str | None:
        """None when every KV page is free, cached, or held by exactly one
        running request; else what is wrong."""
        return self.kv.integrity_problem(self.scheduler.holders())
