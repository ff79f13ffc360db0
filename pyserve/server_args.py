"""The command line: ServerArgs is the option groups of options.py side by
side, and its argparse parser is built from their fields, so a new option
is one line there. At start-up `resolved()` turns "auto" into what this
machine runs, once, and `split()` hands each layer its own group.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import typing
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from pyserve.model.hub import check_revision, local_model_dir
from pyserve.option_fields import add_arguments, comma_list
from pyserve.options import EngineOptions, ModelOptions, Options, ServerOptions


@dataclass(frozen=True)
class ServerArgs(ServerOptions, EngineOptions, ModelOptions):
    """Every option, as the command line (or create_app's keywords) gives
    them; `split()` makes them each layer's."""

    GROUPS = (ModelOptions, EngineOptions, ServerOptions)  # in --help's order

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog="pyserve", description="OpenAI-compatible LLM inference server")
        hints = typing.get_type_hints(cls)
        for group in cls.GROUPS:
            section = p.add_argument_group(group.__name__.removesuffix("Options").lower() + " options")
            add_arguments(section, fields(group), hints)
        return p

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> ServerArgs:
        parser = cls.parser()
        args = cls(**vars(parser.parse_args(argv)))
        try:
            args.validate()
        except ValueError as e:
            parser.error(str(e))
        return args

    def validate(self) -> None:
        """Raise ValueError, naming the option, for a value pyserve cannot run with."""
        self._validate_tensor_parallel()
        if self.page_size < 1:
            raise ValueError("--page-size must be at least 1")
        try:
            overrides = self.config_overrides
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-model-override-args is not JSON: {e}") from None
        if not isinstance(overrides, dict):
            raise ValueError("--json-model-override-args must be a JSON object of config.json keys")
        if self.speculative_config is not None:
            self._expanded()
        if self.preferred_sampling_params is not None:
            self.preferred_sampling()
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError("--mem-fraction-static must be in (0, 1]")
        if not 0 < self.swa_full_tokens_ratio <= 1:
            raise ValueError("--swa-full-tokens-ratio must be in (0, 1]")
        for name in ("backlog", "max_connections", "max_sequences_per_request", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.header_read_timeout <= 0:
            raise ValueError("--header-read-timeout must be positive")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError("--max-queued-requests must be at least 1")
        if self.watchdog_timeout is not None and self.watchdog_timeout <= 0:
            raise ValueError("--watchdog-timeout must be positive")
        if self.drain_timeout < 0:
            raise ValueError("--drain-timeout must not be negative")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError("--root-path must start with / and not end with one, e.g. /llm")
        for item in comma_list(self.forwarded_allow_ips):
            try:
                if item != "*":
                    ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"--forwarded-allow-ips: {item!r} is not an address or network") from None
        if self.is_embedding:
            self._validate_embedding()
        if self.skip_tokenizer_init:
            self._validate_without_text()
        check_revision(self.model_path, self.revision, "--model", "--revision")
        check_revision(self.speculative_draft_model_path, self.speculative_draft_model_revision,
                       "--speculative-draft-model-path", "--speculative-draft-model-revision")
        for origin in comma_list(self.allowed_origins):
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"--allowed-origins: {origin!r} is not an origin such as https://app.example")
        names = comma_list(self.metrics_names)
        if not names or not set(names) <= {"pyserve", "sglang", "vllm"}:
            raise ValueError("--metrics-names takes one or more of pyserve, sglang, vllm, comma-separated")

    # Options about generated text, which an embedding server never makes.
    _GENERATION_ONLY = ("chat_template", "reasoning_parser", "tool_call_parser", "default_max_tokens",
                        "enable_torch_compile")

    def _validate_without_text(self) -> None:
        """--skip-tokenizer-init leaves no tokenizer for what reads or writes text."""
        given = [flag for flag, on in (("--chat-template", self.chat_template), ("--reasoning-parser",
                 self.reasoning_parser), ("--tool-call-parser", self.tool_call_parser),
                 ("--completion-template", self.completion_template not in ("auto", "none")),
                 ("--is-embedding", self.is_embedding)) if on]
        if given:
            raise ValueError(f"{', '.join(given)}: needs the tokenizer, which --skip-tokenizer-init does not load")

    def _validate_embedding(self) -> None:
        given = [name for name in self._GENERATION_ONLY if getattr(self, name) not in (None, False)]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise ValueError(f"{flags}: generation options make no sense with --is-embedding (a model that embeds "
                             "or scores)")

    def _validate_tensor_parallel(self) -> None:
        if self.dp_size != 1:
            raise ValueError(f"--dp-size {self.dp_size}: one engine runs per server; serve replicas behind the smg "
                             "gateway (README, Deployment), or split the model with --tp-size")
        if self.pp_size != 1:
            raise ValueError(f"--pp-size {self.pp_size}: pipeline parallelism is not supported; split the model "
                             "over ranks with --tp-size")
        if self.tp_size < 1 or self.nnodes < 1:
            raise ValueError("--tp-size and --nnodes must be at least 1")
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes} "
                             "(each node runs as many ranks)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be between 0 and --nnodes - 1 ({self.nnodes - 1})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError(f"--nnodes {self.nnodes} needs --dist-init-addr HOST:PORT, an address of node 0 "
                             "that every node reaches")
        if self.dist_init_addr is not None and not re.fullmatch(r"[^\s:]+:\d{1,5}|\[[0-9a-fA-F:.]+\]:\d{1,5}",
                                                                self.dist_init_addr):
            raise ValueError(f"--dist-init-addr {self.dist_init_addr!r} is not HOST:PORT")
        if self.tp_size > 1 and self.enable_torch_compile:
            raise ValueError("--enable-torch-compile is not supported with --tp-size > 1 (the compiled layers "
                             "would hold the ranks' all-reduce); it buys little on the CPU anyway")

    def resolved(self) -> ServerArgs:
        """A copy with every "auto" made concrete for this machine: device
        ("cpu" or "cuda"), dtype, attention backend and overlap scheduling
        (a bool); --is-embedding for a model that cannot generate; the CUDA graphs' largest batch, which every rank
        captures alike, capped by the running batch; Hub ids as local directories; and the speculative
        draft's shape, which the model's architecture decides where left out. Resolving a resolved
        copy changes nothing. Start-up resolves once, then splits."""
        import torch  # here, so that `pyserve --help` answers without loading torch

        cuda_available = torch.cuda.is_available()
        if self.device == "cuda" and not cuda_available:
            raise ValueError("--device cuda was asked for, but CUDA is not available")
        device = self.device
        if device == "auto":
            device = "cuda" if cuda_available else "cpu"
        on_cuda = device == "cuda"
        located = self._expanded()._located()
        if not located.is_embedding and located._scores_only():
            located = replace(located, is_embedding=True)
            located._validate_embedding()
        return replace(
            located,
            device=device,
            dtype=("bfloat16" if on_cuda else "float32") if self.dtype == "auto" else self.dtype,
            attention_backend=(("triton" if on_cuda else "torch") if self.attention_backend == "auto"
                               else self.attention_backend),
            disable_overlap_schedule=(not on_cuda or self.speculative_algorithm is not None
                                      if self.disable_overlap_schedule is None else self.disable_overlap_schedule),
            cuda_graph_max_bs=min(self.cuda_graph_max_bs, self.max_running_requests),
            **located._draft_shape(on_cuda),
        )

    def _expanded(self) -> ServerArgs:
        """A copy with --speculative-config read as the options it means
        (speculative_config.py); ValueError where those are given too."""
        if self.speculative_config is None:
            return self
        from pyserve.speculative_config import speculative_options

        values = speculative_options(self.speculative_config, self.tp_size)
        given = [flag for flag in self.speculative_flags_given() if flag != "--speculative-config"]
        if given:
            raise ValueError(f"--speculative-config says what {', '.join(given)} would: give one or the other")
        return replace(self, speculative_config=None, **values)

    def _located(self) -> ServerArgs:
        """A copy whose paths are local: Hub ids as their snapshots (the API keeps the name given)."""
        model_path = self.model_path and local_model_dir(self.model_path, self.revision, self.download_dir, "--model")
        tokenizer_path = self.tokenizer_path and local_model_dir(self.tokenizer_path, None, self.download_dir,
                                                                 "--tokenizer-path")
        draft_path = self.speculative_draft_model_path
        if self.speculative_algorithm is not None and draft_path:  # without it, start-up refuses the option
            draft_path = local_model_dir(draft_path, self.speculative_draft_model_revision, self.download_dir,
                                         "--speculative-draft-model-path", "--speculative-draft-model-revision",
                                         torch_binaries=self.speculative_algorithm in ("EAGLE", "EAGLE3"))
        return replace(self, model_path=model_path, tokenizer_path=tokenizer_path, speculative_draft_model_path=draft_path,
                       served_model_name=self.served_model_name or self.model_path)

    def _scores_only(self) -> bool:
        """Whether the model embeds or scores and cannot generate (an encoder,
        a sequence classifier, a base model without its vocabulary
        projection, a decoder trained to attend both ways), so that it is
        served as --is-embedding asks, as SGLang and vLLM tell by its architecture."""
        from pyserve.model.config import read_config_files
        from pyserve.model.families import scores_only

        if not self.model_path or not (Path(self.model_path) / "config.json").is_file():
            return False
        return scores_only(read_config_files(self.model_path, self.config_overrides)[0]) is not None

    def _draft_shape(self, on_cuda: bool) -> dict[str, int | None]:
        """--speculative-num-steps, -eagle-topk and -num-draft-tokens, made
        concrete where speculation is on."""
        if self.speculative_algorithm is None:
            return {}
        from pyserve.engine.speculative.options import draft_shape

        steps, topk, tokens = draft_shape(self.speculative_algorithm, self.model_path, on_cuda,
                                          self.speculative_num_steps, self.speculative_eagle_topk,
                                          self.speculative_num_draft_tokens)
        return dict(speculative_num_steps=steps, speculative_eagle_topk=topk, speculative_num_draft_tokens=tokens)

    def split(self) -> Options:
        """Each layer's group of these options (resolved ones: see `resolved`)."""
        server, engine, model = (group(**{f.name: getattr(self, f.name) for f in fields(group)})
                                 for group in (ServerOptions, EngineOptions, ModelOptions))
        return Options(server, engine, model)

    def reported(self) -> dict[str, Any]:
        """Every option by name but the secret ones: what /get_server_info
        reports, as SGLang's does."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.metadata["secret"]}
