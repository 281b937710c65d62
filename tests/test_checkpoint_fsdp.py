"""checkpoint.save / load / latest / verify of FSDP2 models: layout 2 on torch.distributed.checkpoint (2 gloo ranks).

The 2-rank half is tests/support/_checkpoint_fsdp_worker.py (its docstring lists the cases). Here, in one
plain process: the world-2 checkpoint loads at world 1 (resharding), a flipped byte in any file is refused
with nothing changed, a pickle is never run (a ``.metadata`` file put beside the shards, a pickle that the
manifest vouches for, DCP's own pickled ``.metadata``), the resumed run equals torch's own resumed run bit
for bit (slow), and a save SIGKILLed at any stage leaves the previous checkpoint whole (slow).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from offload_adamw import OffloadAdamW, checkpoint
from offload_adamw.checkpoint import CheckpointCorrupt, CheckpointError, CheckpointMismatch

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
from _checkpoint_fsdp_worker import build
from _distributed_common import LR, WEIGHT_DECAY, TinyCausalLM, full_params, train

WORKER = Path(__file__).resolve().parent / "support" / "_checkpoint_fsdp_worker.py"


def run_worker(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WORKER), "--out", str(out), *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("checkpoint_fsdp")
    proc = run_worker(out, "--cases", "round_trip", "partial", "bf16_masters", "refusals", "converted", "ddp")
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return out


@pytest.mark.parametrize("case", ["round_trip", "partial", "bf16_masters", "refusals", "converted", "ddp"])
def test_two_ranks(run_dir, case):
    for rank in range(2):
        result = json.loads((run_dir / f"rank{rank}.json").read_text())
        assert case in result, f"rank {rank} did not run {case}"
        assert result[case]["ok"], f"rank {rank}, {case}:\n{result[case]['error']}"


def plain():
    model = build()
    return model, OffloadAdamW(model.parameters(), lr=1e-2)


def values(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_world2_checkpoint_loads_into_one_plain_process(run_dir):
    model, optimizer = plain()
    report = checkpoint.load(run_dir / "ck", model, optimizer)
    expected = load_file(run_dir / "ck_expected.safetensors")
    assert report.step == 2 and report.optimizer_restored and report.rng_restored
    assert sorted(report.loaded) == sorted(expected)
    assert all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)
    assert {float(s["step"]) for s in optimizer.state.values()} == {2.0}
    assert checkpoint.verify(run_dir / "ck")["world_size"] == 2


def test_other_parameter_groups_are_refused_by_name_with_nothing_changed(run_dir):
    """Saved with one group; an optimizer with weights and biases in two groups must not take the saved
    hyperparameters onto the wrong parameters: refused, naming a parameter in another group."""
    model = build()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = OffloadAdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=1e-2)
    before = values(model)
    with pytest.raises(CheckpointMismatch) as caught:
        checkpoint.load(run_dir / "ck", model, optimizer)
    assert "group" in str(caught.value) and "0.bias" in str(caught.value), caught.value
    assert caught.value.report.group_mismatch, caught.value.report
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not optimizer.state


def test_a_load_between_a_backward_that_updated_and_step_is_refused_naming_the_optimizer(run_dir):
    """update_in_backward=True, after a backward that already updated parameters: DCP's get_optimizer_state_dict
    calls the optimizer's own state_dict(), which refuses; the load says so as a CheckpointError and changes
    nothing (not a bare RuntimeError from inside DCP)."""
    model = build()
    optimizer = OffloadAdamW(model.parameters(), lr=1e-2, offload_gradients=True, update_in_backward=True,
                             bucket_bytes=64)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(5))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    model(x).square().mean().backward()
    rng_before = torch.get_rng_state()
    with pytest.raises(CheckpointError, match="update_in_backward=True"):
        checkpoint.load(run_dir / "ck", model, optimizer)
    assert torch.equal(torch.get_rng_state(), rng_before)
    optimizer.step()


def test_a_model_on_the_meta_device_is_refused_by_name(run_dir):
    with torch.device("meta"):
        model = build()
    with pytest.raises(CheckpointMismatch, match="meta device '0.weight'"):
        checkpoint.load(run_dir / "ck", model, None)


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "ck"
    shutil.copytree(run_dir / "ck", target)
    return target


def refused_unchanged(path: Path, error=CheckpointCorrupt) -> str:
    model, optimizer = plain()
    before = values(model)
    with pytest.raises(error) as caught:
        checkpoint.load(path, model, optimizer)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a refused load changed the model"
    assert not optimizer.state, "a refused load changed the optimizer"
    return str(caught.value)


def test_a_flipped_byte_in_any_file_is_refused_naming_it(run_dir, tmp_path):
    files = sorted(p.name for p in (run_dir / "ck").iterdir())
    assert len(files) == 9, files
    for name in files:
        path = copy_of(run_dir, tmp_path / name)
        data = bytearray((path / name).read_bytes())
        data[len(data) // 2] ^= 0x04
        (path / name).write_bytes(bytes(data))
        message = refused_unchanged(path)
        assert name in message or name in ("COMMIT", "manifest.json"), (name, message)
        with pytest.raises(CheckpointCorrupt):
            checkpoint.verify(path)


@pytest.mark.parametrize("name", ["shard-00002-model-00001-of-00001.safetensors", "rank-00001.json", "extra-fifo"])
def test_a_fifo_in_the_directory_is_refused_by_name_without_blocking(run_dir, tmp_path, name):
    import os

    path = copy_of(run_dir, tmp_path)
    (path / name).unlink(missing_ok=True)
    os.mkfifo(path / name)  # opening it for reading would block until a writer comes
    message = refused_unchanged(path)
    assert name in message and ("a FIFO" in message or "not opened" in message), message


class RunsCode:
    """A pickle that, if loaded, writes ``marker``: what a malicious checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('the pickle ran')",))


def test_a_pickle_metadata_file_beside_the_shards_is_refused_unopened(run_dir, tmp_path):
    path = copy_of(run_dir, tmp_path)
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    message = refused_unchanged(path)
    assert ".metadata is not in the manifest" in message and "not opened" in message, message
    with pytest.raises(CheckpointCorrupt):
        checkpoint.verify(path)
    assert not marker.exists()


def reseal(path: Path) -> None:
    """Rewrite the manifest and the commit marker over the files as they are now (a forger's checkpoint)."""
    manifest = json.loads((path / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (path / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    raw = json.dumps(manifest).encode()
    (path / "manifest.json").write_bytes(raw)
    commit = json.loads((path / "COMMIT").read_text())
    commit["manifest_sha256"] = hashlib.sha256(raw).hexdigest()
    (path / "COMMIT").write_text(json.dumps(commit))


@pytest.mark.parametrize("name", ["meta.json", "rank-00000.json", "rank-00000.safetensors",
                                  "shard-00001-model-00001-of-00001.safetensors"])
def test_a_pickle_that_the_manifest_vouches_for_never_runs(run_dir, tmp_path, name):
    path = copy_of(run_dir, tmp_path)
    marker = tmp_path / "ran"
    (path / name).write_bytes(pickle.dumps(RunsCode(marker)))
    reseal(path)
    message = refused_unchanged(path)
    assert name in message, message
    assert not marker.exists()


def test_a_manifest_naming_a_file_outside_the_directory_is_refused_unopened(run_dir, tmp_path):
    path = copy_of(run_dir, tmp_path)
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["../secret.json"] = {"bytes": 2, "sha256": hashlib.sha256(b"{}").hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    reseal(path)
    message = refused_unchanged(path)
    assert "../secret.json" in message and "no save writes" in message, message


def test_dcp_own_checkpoint_with_a_malicious_metadata_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "dcp"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=path)
    marker = tmp_path / "ran"
    (path / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))
    refused_unchanged(path, CheckpointError)
    assert not marker.exists()


@pytest.mark.slow
def test_world2_fsdp2_resumed_at_world1_and_under_ddp_equals_torchs_own_resumed_run(tmp_path):
    """Saved at world 2 under FSDP2 (OffloadAdamW through checkpoint.save; torch.optim.AdamW(fused=True) through
    dcp.save of get_state_dict), resumed the same way by each: under DDP at world 2 (in the worker) and in one
    plain process here; 3 more steps: every parameter bit for bit torch's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    proc = run_worker(tmp_path, "--cases", "reshard")
    assert proc.returncode == 0, f"worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())["reshard"]
        assert result["ok"], f"rank {rank}: {result['error']}"
    ours = TinyCausalLM(5)
    ours_opt = OffloadAdamW(ours.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    report = checkpoint.load(tmp_path / "ours", ours, ours_opt)
    theirs = TinyCausalLM(5)
    theirs_opt = torch.optim.AdamW(theirs.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
    model_sd, optim_sd = get_state_dict(theirs, theirs_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=tmp_path / "torch")
    set_state_dict(theirs, theirs_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert report.step == 3
    train(ours, ours_opt, range(3, 6), None)
    train(theirs, theirs_opt, range(3, 6), None)
    got, want = full_params(ours), full_params(theirs)
    assert all(torch.equal(got[k], want[k]) for k in want), {k: (got[k] - want[k]).abs().max().item() for k in want}


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["shards", "seal", "publish"])
def test_a_save_killed_at_any_stage_leaves_the_previous_checkpoint_whole(tmp_path, stage):
    proc = run_worker(tmp_path, "--kill", stage)
    assert proc.returncode != 0, "the killed save finished"
    assert not list(tmp_path.glob("rank*-survived"))
    model, optimizer = plain()
    report = checkpoint.load(tmp_path / "ck", model, optimizer)
    expected = load_file(tmp_path / "ck_expected.safetensors")
    assert report.step == 2 and all(torch.equal(model.state_dict()[k], expected[k]) for k in expected)
    assert checkpoint.latest(tmp_path) == tmp_path / "ck"
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".ck.tmp-")]
    if stage != "shards":  # rank 0 itself was killed, so nothing removed its temporary
        assert leftovers, "the killed save left no temporary: the kill came too late to test anything"
    # (rank 1 killed: rank 0's collective fails and it removes the temporary itself, or is terminated first)
    checkpoint.save(tmp_path / "other", model, optimizer)  # a later save deletes what the killed one left
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ck.tmp-")]


@pytest.mark.slow
def test_a_sharded_save_does_not_hold_a_second_copy_of_the_state():
    """DCP's own safetensors writer builds each rank's file in memory (+1.0 x the state, measured); ours streams."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "checkpoint_memory.py"
    out = subprocess.run([sys.executable, str(script), "--mb", "96", "--layout", "sharded"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["excess_over_state"] < 0.25, row
