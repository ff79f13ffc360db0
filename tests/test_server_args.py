"""ServerArgs: each option declared once, and "auto" resolved in one place."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from pyserve.server_args import ServerArgs


@pytest.fixture
def cuda(monkeypatch):
    """Pretend CUDA is there (True) or not (False)."""

    def pretend(available: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: available)

    return pretend


def test_every_field_is_an_option_with_its_default():
    parser = ServerArgs.parser()
    dests = {action.dest: action for action in parser._actions if action.dest != "help"}
    assert set(dests) == {f.name for f in fields(ServerArgs)}
    assert ServerArgs.from_cli([]) == ServerArgs()
    for f in fields(ServerArgs):
        assert dests[f.name].help, f"--{f.name} has no help"


def test_values_are_converted_to_the_field_types():
    args = ServerArgs.from_cli(["--port", "8080", "--mem-fraction-static", "0.5", "--context-length", "512",
                                "--disable-cuda-graph", "--host", "0.0.0.0"])
    assert (args.port, args.mem_fraction_static, args.context_length) == (8080, 0.5, 512)
    assert args.disable_cuda_graph is True and args.host == "0.0.0.0"
    assert ServerArgs.from_cli(["--tp", "1"]).tp_size == 1


def test_choices_are_enforced(capsys):
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--device", "tpu"])
    assert "--device" in capsys.readouterr().err


def test_auto_resolves_to_cpu_settings_without_cuda(cuda):
    cuda(False)
    args = ServerArgs().resolved()
    assert (args.device, args.dtype, args.attention_backend) == ("cpu", "float32", "torch")
    assert args.disable_overlap_schedule is True


def test_auto_resolves_to_cuda_settings_with_cuda(cuda):
    cuda(True)
    args = ServerArgs().resolved()
    assert (args.device, args.dtype, args.attention_backend) == ("cuda", "bfloat16", "triton")
    assert args.disable_overlap_schedule is False


def test_explicit_choices_are_kept(cuda):
    cuda(True)
    args = ServerArgs(device="cpu", dtype="float16", attention_backend="triton",
                      disable_overlap_schedule=False).resolved()
    assert (args.device, args.dtype, args.attention_backend) == ("cpu", "float16", "triton")
    assert args.disable_overlap_schedule is False  # --enable-overlap-schedule on CPU
    assert ServerArgs(device="cpu").resolved().dtype == "float32"


def test_resolving_is_idempotent_and_leaves_the_original(cuda):
    for available in (False, True):
        cuda(available)
        original = ServerArgs()
        once = original.resolved()
        assert once.resolved() == once
        assert original == ServerArgs()  # a copy: the declared "auto" stays


def test_cuda_asked_for_but_absent_is_a_clear_error(cuda):
    cuda(False)
    with pytest.raises(ValueError, match="--device cuda was asked for, but CUDA is not available"):
        ServerArgs(device="cuda").resolved()
