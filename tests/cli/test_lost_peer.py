"""A collective failing on a lost or hung peer as one line (dfpo_trl/cli/peers.py); end to end, with a killed and a
hung process of a 2-process launch, in tests/cli/test_killed_rank.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from tiny import write_tiny_recipe

from dfpo_trl.cli import train
from dfpo_trl.cli.main import main
from dfpo_trl.cli.peers import PeerLost, lost_peer_as_one_line, lost_peer_cause

# gloo's own messages (torch 2.13), as the surviving process of tests/cli/test_killed_rank.py raised them
RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:9619: "
         "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application. "
         "Check the logs of the remote worker before reporting an error. GLHF! 🏖️")
TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting "
           "20000ms for send operation to complete")


def test_cause_is_gloos_own_words_and_other_errors_are_not_peers() -> None:
    assert lost_peer_cause(RuntimeError(RESET)) == "Read error [127.0.0.1]:9619: Connection reset by peer"
    assert lost_peer_cause(RuntimeError(TIMEOUT)) == "Timed out waiting 20000ms for send operation to complete"
    assert lost_peer_cause(dist.DistNetworkError("Connection was likely closed.\nmore")) == \
        "Connection was likely closed"
    assert lost_peer_cause(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert lost_peer_cause(ValueError(RESET)) is None


def trainer(tmp_path: Path, step: int = 4) -> SimpleNamespace:
    args = SimpleNamespace(ddp_timeout=20, output_dir=str(tmp_path))
    return SimpleNamespace(args=args, state=SimpleNamespace(global_step=step))


def test_one_line_names_the_process_the_timeout_and_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timeout names ddp_timeout as what ended the wait; a lost connection, that a hang would be waited for it;
    both the last whole checkpoint (a half-written one after it is passed over), or that there is none."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for error in (RuntimeError(RESET), RuntimeError(TIMEOUT)):
        with pytest.raises(PeerLost) as caught, lost_peer_as_one_line(trainer(tmp_path)):
            raise error
        assert "\n" not in str(caught.value) and str(caught.value).endswith("no checkpoint was written yet")
    whole = tmp_path / "checkpoint-3"
    whole.mkdir()
    (whole / "trainer_state.json").write_text("{}")
    (whole / "model.safetensors").write_bytes(b"w")
    (tmp_path / "checkpoint-6").mkdir()  # killed during its save: nothing of the main process's in it
    (tmp_path / "checkpoint-6" / "rng_state_1.pth").write_bytes(b"r")
    with pytest.raises(PeerLost) as caught, lost_peer_as_one_line(trainer(tmp_path)):
        raise RuntimeError(TIMEOUT)
    assert str(caught.value) == (
        "process 0 of 2 waited ddp_timeout (20 s) for another process in a collective after step 4 (Timed out "
        "waiting 20000ms for send operation to complete): another process of the run hangs or died, or its node is "
        f"gone; its launcher's log names it. Stopped; nothing was written; the last whole checkpoint, {whole}, is "
        "where --resume_from_checkpoint restarts")
    with pytest.raises(PeerLost) as caught, lost_peer_as_one_line(trainer(tmp_path)):
        raise RuntimeError(RESET)
    assert str(caught.value).startswith(
        "process 0 of 2 lost its connection to another process in a collective after step 4 (Read error "
        "[127.0.0.1]:9619: Connection reset by peer): another process of the run died; its launcher's log names it "
        "(a hung process or a node that is gone is waited for ddp_timeout, 20 s)")
    with pytest.raises(RuntimeError, match="shapes"), lost_peer_as_one_line(trainer(tmp_path)):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")


def test_main_prints_the_line_alone_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def lost(_argv: list[str], _callbacks: object = ()) -> dict:
        raise PeerLost("process 1 of 2 lost its connection to another process")

    monkeypatch.setattr(train, "parse_and_run", lost)
    assert main(write_tiny_recipe(tmp_path, output_dir=tmp_path / "out")) == 1
    printed = capsys.readouterr()
    assert printed.err == "dfpo-train: process 1 of 2 lost its connection to another process\n"
