"""``offload-adamw selftest``: the exit statuses, the JSON document, a broken kernel caught by name, every row on the
simulated CUDA device, and the GPU run's pieces rehearsed on the CPU (the token choice, the host-memory figure).

The command runs in this process (``cli.main.main``) where a test needs to break a kernel or install the simulated
device: what it prints and returns is what a user sees. The rows run for real against torch's fused AdamW; no row
is mocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload_adamw import OffloadAdamW
from offload_adamw.accel import streams
from offload_adamw.cli.main import main
from offload_adamw.distributed import node
from offload_adamw.selftest import environment, parity
from offload_adamw.selftest.bench import LLAMA_ROWS

FULL = "/dev/full"


def _selftest(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(["selftest", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_exact_rows_exit_0_with_a_verdict_and_a_json_document(capsys, tmp_path) -> None:
    target = tmp_path / "selftest.json"
    status, out, _ = _selftest(capsys, "--device", "cpu", "--rows", "host/freed/*/clip,mix/kept/*",
                               "--json", str(target))
    assert status == 0, out
    assert out.strip().splitlines()[-1].startswith("selftest: EXACT: all 4 rows bitwise"), out
    document = json.loads(target.read_text())
    assert document["schema_version"] == 1 and document["command"] == "selftest"
    assert set(document) >= {"environment", "parity", "bench", "verdict"}
    env = document["environment"]
    assert env["device"] == "cpu" and env["torch"] == torch.__version__ and env["cores_available"] >= 1
    assert env["host_update"]["threads"] == OffloadAdamW([torch.nn.Parameter(torch.ones(1))]).host_threads
    assert env["host_memory"]["total_bytes"] > 0 and env["memlock"]["readable"]
    rows = {r["row"]: r for r in document["parity"]["rows"]}
    assert set(rows) == {"host/freed/step/clip", "host/freed/backward/clip", "mix/kept/step/noclip",
                         "mix/kept/step/clip", "mix/kept/backward/noclip", "mix/kept/backward/clip"}
    assert [rows[n]["status"] for n in sorted(rows)] == ["exact", "exact", "skipped", "skipped", "exact", "exact"]
    assert "freed gradients" in rows["mix/kept/backward/clip"]["why"]
    assert document["verdict"] == {**document["verdict"], "exact": True, "rows_run": 4, "rows_skipped": 2,
                                   "rows_not_exact": []}
    assert document["bench"] is None
    # with clipping an update waits for the global norm, known when backward ends: none begins before
    assert rows["host/freed/backward/clip"]["buckets_started_in_backward"] == 0 < rows["host/freed/backward/clip"]["buckets"]


def _one_ulp_more(tensors) -> None:
    """The first element of the first tensor moved to the next float above: the smallest wrong update."""
    first = next(t for t in tensors if t.numel())
    with torch.no_grad():
        flat = first.view(-1)
        flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf"), dtype=flat.dtype))


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_kernel_one_ulp_off_makes_it_exit_1_naming_the_row_and_the_element(capsys, monkeypatch, path) -> None:
    if path == "host":  # the host kernel every host group's update calls (optim/update.py)
        import offload_adamw.optim.update as module

        real = module.adamw_update_

        def broken(masters, *args, **kwargs):
            real(masters, *args, **kwargs)
            _one_ulp_more(masters)

        monkeypatch.setattr(module, "adamw_update_", broken)
    else:  # torch's fused AdamW as a resident group calls it (accel/device_update.py)
        import offload_adamw.accel.device_update as module

        real = module.fused_adamw_

        def broken(masters, *args, **kwargs):
            real(masters, *args, **kwargs)
            _one_ulp_more(masters)

        monkeypatch.setattr(module, "fused_adamw_", broken)
    row = f"{path}/kept/step/noclip"
    status, out, _ = _selftest(capsys, "--device", "cpu", "--rows", f"{row},{path}/freed/step/noclip")
    assert status == 1, out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("selftest: NOT EXACT: 2 of 2 rows") and f"first {row} (differs)" in verdict, verdict
    assert "step 0: " in verdict and " master[0" in verdict and "ours " in verdict and "torch " in verdict


def test_a_row_that_raises_is_an_error_row_and_the_others_still_run(capsys, monkeypatch) -> None:
    """An optimizer whose streamed update raises: that row is an error (exit 1, named with the exception), the
    host row after it still runs and is exact."""
    import offload_adamw.selftest.parity as module

    class Raises(module.OffloadAdamW):
        def step(self, closure=None):
            if any(g.get("update_on") == "stream" for g in self.param_groups):
                raise RuntimeError("the ring broke\nsecond line")
            return super().step(closure)

    monkeypatch.setattr(module, "OffloadAdamW", Raises)
    status, out, _ = _selftest(capsys, "--device", "cpu", "--rows", "stream/kept/step/noclip,host/kept/step/noclip")
    assert status == 1
    verdict = out.strip().splitlines()[-1]
    assert "1 of 2 rows" in verdict and "first stream/kept/step/noclip (error): RuntimeError: the ring broke" in verdict
    assert verdict.endswith("the ring broke"), verdict
    assert any(line.startswith("host/kept/step/noclip") and " exact " in line for line in out.splitlines())


def test_every_line_fits_the_terminal_but_the_verdict_and_a_bar_only_when_asked(capsys, monkeypatch) -> None:
    """The tables wrap their widest column and the prose wraps: at 64 columns only the verdict (one line, for grep)
    is longer. A progress bar goes to stderr when asked (a terminal asks by default), never to stdout."""
    monkeypatch.setenv("COLUMNS", "64")
    status, out, err = _selftest(capsys, "--device", "cpu", "--rows", "mix/freed/*/clip")
    assert status == 0
    *lines, verdict = out.strip().splitlines()
    assert [line for line in lines if len(line) > 64] == [] and verdict.startswith("selftest: EXACT")
    assert "parity" not in err  # stderr is no terminal here: no bar
    status, out_with_bar, err = _selftest(capsys, "--device", "cpu", "--rows", "mix/freed/*/clip", "--progress")
    assert status == 0 and "parity" in err and "2/2" in err and "\r" not in out_with_bar


def test_usage_errors_exit_2_before_any_work(capsys, tmp_path) -> None:
    cases = [(["--device", "nonsense"], "not a device"), (["--device", "meta"], "cpu or cuda"),
             (["--json", str(tmp_path)], "is a directory"), (["--rows", "host/nowhere"], "matches no row"),
             (["--budget-s", "0"], "--budget-s"), (["--budget-s", "nan"], "--budget-s"),
             (["--bench-size", "huge"], "invalid choice")]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "no CUDA device here"))
    for argv, culprit in cases:
        status, out, err = _selftest(capsys, *argv)
        assert status == 2 and out == "", (argv, status, out)
        assert len(err.strip().splitlines()) == 1 and culprit in err, (argv, err)


@pytest.mark.skipif(not Path(FULL).exists(), reason="needs /dev/full")
def test_a_json_file_that_takes_no_write_is_refused_before_any_work(capsys) -> None:
    """As every command does (cli/common.py): /dev/full refuses even a zero-byte write, so it is a usage error."""
    status, out, err = _selftest(capsys, "--device", "cpu", "--json", FULL)
    assert status == 2 and out == "" and "No space left on device" in err, err


def test_a_json_write_that_fails_at_the_end_is_exit_74(tmp_path) -> None:
    """The work done and printed, the file refused at the end (a file-size limit): 74 and one line, as elsewhere.
    A process of its own (the file-size limit must not reach pytest's own files), one resident row: about 5 s."""
    target = tmp_path / "selftest.json"

    def limit() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))

    done = subprocess.run([sys.executable, "-m", "offload_adamw", "selftest", "--device", "cpu", "--rows",
                           "device/kept/step/noclip", "--json", str(target)], capture_output=True, text=True,
                          timeout=300, preexec_fn=limit)
    assert done.returncode == 74 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"offload-adamw selftest: --json {target}: could not write")
    assert "selftest: EXACT" in done.stdout


def test_json_to_stdout_is_the_document_alone(capsys) -> None:
    status, out, err = _selftest(capsys, "--device", "cpu", "--rows", "stream/freed/backward/noclip", "--json")
    assert status == 0
    document = json.loads(out)
    assert document["verdict"]["exact"] and "selftest: EXACT" in err


@pytest.mark.parametrize("simulated_device", [101], indirect=True)
def test_rows_of_every_placement_run_on_the_simulated_cuda_device(capsys, simulated_device, tmp_path) -> None:
    """The stream lane runs over the simulated device (late copies into poisoned buffers, hazards recorded: the
    fixture fails on any), a row of each placement and mode with clipping; the slow tier runs every row."""
    target = tmp_path / "selftest.json"
    status, out, _ = _selftest(capsys, "--device", "cpu", "--rows", "stream/kept/step/clip,device/freed/backward/clip,"
                               "mix/freed/step/clip,host/freed/backward/clip", "--json", str(target))
    assert status == 0, out
    document = json.loads(target.read_text())
    assert document["environment"]["stream_backend"] == "SimulatedCuda"
    assert [r["status"] for r in document["parity"]["rows"]] == ["exact"] * 4


@pytest.mark.slow
@pytest.mark.parametrize("simulated_device", [102], indirect=True)
def test_every_row_runs_on_the_simulated_cuda_device(capsys, simulated_device) -> None:
    status, out, _ = _selftest(capsys, "--device", "cpu")
    assert status == 0, out
    assert out.strip().splitlines()[-1].startswith(f"selftest: EXACT: all {len(parity.ROWS) - 8} rows bitwise")


@pytest.mark.slow
def test_the_whole_table_and_a_tiny_bench_on_the_cpu(capsys, tmp_path) -> None:
    """The command a user runs on a CPU, and the GPU run rehearsed (``--bench`` with the tiny Llama): every row
    exact within two minutes, every bench section ran or says why not."""
    pytest.importorskip("transformers")
    target = tmp_path / "selftest.json"
    status, out, _ = _selftest(capsys, "--device", "cpu", "--bench", "--json", str(target))
    assert status == 0, out
    document = json.loads(target.read_text())
    assert sum(r["seconds"] for r in document["parity"]["rows"]) < 120
    bench = document["bench"]
    assert bench["size"] == "tiny" and bench["pcie"] == {**bench["pcie"], "status": "skipped", "why": "needs a CUDA device"}
    assert bench["host_triad"]["status"] == "ok" and bench["host_step"]["status"] == "ok"
    rows = bench["llama"]["rows"]
    assert [r["row"] for r in rows] == list(LLAMA_ROWS)
    assert all(r["status"] == "ok" and r["step_s"] > 0 for r in rows), rows
    assert bench["llama"]["tokens"]["tokens"] % bench["llama"]["tokens"]["seq"] == 0
    assert "tokens per step" in out


def test_the_token_count_lets_backward_hide_the_host_update() -> None:
    """1.1 B parameters at 1 ns per element of host step and 25 GB/s: about 1.28 s of update; at 10 us of backward
    per token 1.25x needs 160,000 tokens, 79 sequences of 2048; with room for 100,000 tokens it is capped, saying so."""
    from offload_adamw.selftest.bench import choose_tokens

    probe = {"backward_s_per_token": 10e-6, "activation_bytes_per_token": 1000.0}
    chosen = choose_tokens(1_100_000_000, 1e-9, 25.0, probe, 2048, 1 << 20, None)
    assert chosen["update_s"] == pytest.approx(1.1 + 0.176)
    assert chosen["sequences"] == 78 and chosen["tokens"] == 78 * 2048 and not chosen["capped"]
    assert chosen["tokens"] * probe["backward_s_per_token"] >= chosen["update_s"] * 1.25 - 2048 * 10e-6
    capped = choose_tokens(1_100_000_000, 1e-9, 25.0, probe, 2048, 1 << 20, 100_000 * 1000.0)
    assert capped["capped"] and capped["tokens"] == 48 * 2048 and "device memory" in capped["why"]


def test_host_memory_is_sized_by_memtotal_where_memavailable_is_implausible(tmp_path) -> None:
    """A fresh VM reports a MemAvailable far below MemTotal: under a quarter of it, MemTotal is the figure."""
    fresh = tmp_path / "meminfo"
    fresh.write_text("MemTotal:       134217728 kB\nMemFree:         8000000 kB\nMemAvailable:    9000000 kB\n")
    info = environment.meminfo(str(fresh))
    assert info["MemTotal"] == 134217728 * 1024 and info["MemAvailable"] == 9000000 * 1024
    figure, source = environment.host_memory_for_sizing(info)
    assert figure == info["MemTotal"] and source.startswith("MemTotal: MemAvailable is 7% of it")
    settled = {"MemTotal": 100, "MemAvailable": 60}
    assert environment.host_memory_for_sizing(settled) == (60, "MemAvailable")


@pytest.mark.slow  # about a minute: the tiny bench and the collection of every test module
def test_the_gpu_run_rehearsed_on_the_cpu_writes_at_most_8_files(tmp_path) -> None:
    """``make gpu-check``'s script without CUDA: the selftest with --bench (the tiny sizes), the gpu tests (all
    skipped here), every part's status in its summary, and no more files than come back from the GPU machine."""
    pytest.importorskip("transformers")
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh"), str(out)], capture_output=True,
                          text=True, timeout=540, env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert files == ["gpu-check.txt", "gpu-tests.txt", "selftest.json", "selftest.txt"]
    document = json.loads((out / "selftest.json").read_text())
    assert document["verdict"]["exact"] and document["bench"]["size"] == "tiny"
    summary = (out / "gpu-check.txt").read_text().splitlines()
    assert summary[1].startswith("selftest --bench: exit status 0") and summary[2].startswith("pytest -m gpu: exit status")
    assert "selftest: EXACT" in (out / "selftest.txt").read_text()


def test_the_gpu_run_script_refuses_a_missing_folder_argument() -> None:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and done.stderr.startswith("usage: bash benchmarks/gpu_check.sh OUTDIR")


def test_a_gpu_is_found_by_its_uuid_where_torch_gives_no_pci_fields(tmp_path, monkeypatch) -> None:
    """The one PCI address of a GPU (the optimizer's NUMA placement and the selftest's report read it): torch's PCI
    fields, else the driver's folder whose UUID is the GPU's. The device properties are made up here, as no torch
    without those fields (nor a GPU) is at hand; the driver's folders are laid out as a GPU machine has them."""
    from types import SimpleNamespace

    gpus = tmp_path / "gpus"
    (gpus / "0000:3B:00.0").mkdir(parents=True)
    (gpus / "0000:3B:00.0" / "information").write_text("Model: \t\t NVIDIA H200\nGPU UUID: \t GPU-bbbb-2222\n")
    monkeypatch.setattr(node, "NVIDIA_GPUS", str(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid="bbbb-2222"))
    assert streams.CUDA.pci_bus_id(0) == "0000:3b:00.0"
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid="cccc"))
    assert streams.CUDA.pci_bus_id(0) is None
    fields = {"pci_domain_id": 0, "pci_bus_id": 0x1B, "pci_device_id": 0, "uuid": "bbbb-2222"}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(**fields))
    assert streams.CUDA.pci_bus_id(0) == "0000:1b:00.0"  # torch's fields first


def test_the_gpu_figures_are_read_from_the_driver_and_sysfs_files(tmp_path) -> None:
    """The files as a GPU machine has them (laid out here): the driver's version line, its per-GPU folders named by
    PCI bus id (found by the GPU's UUID where torch gives no bus id), and the NUMA node sysfs gives that bus id.
    The bus id and the node are the optimizer's own lookups (distributed/node.py), which the selftest reports."""
    version = tmp_path / "version"
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
                       "GCC version:  gcc version 12.2.0\n")
    assert environment._driver_version(str(version)) == "550.54.15"
    assert environment._driver_version(str(tmp_path / "absent")) is None
    gpus = tmp_path / "gpus"
    for bus, uuid in (("0000:18:00.0", "aaaa-1111"), ("0000:3B:00.0", "bbbb-2222")):
        (gpus / bus).mkdir(parents=True)
        (gpus / bus / "information").write_text(f"Model: \t\t NVIDIA H200\nGPU UUID: \t GPU-{uuid}\nBus Location: \t {bus}\n")
    assert node.bus_id_by_uuid("bbbb-2222", str(gpus)) == "0000:3b:00.0"
    assert node.bus_id_by_uuid("GPU-aaaa-1111", str(gpus)) == "0000:18:00.0"
    assert node.bus_id_by_uuid("cccc", str(gpus)) is None
    sysfs = tmp_path / "sys"
    for bus, numa in (("0000:3b:00.0", "1"), ("0000:5e:00.0", "-1")):
        (sysfs / "bus/pci/devices" / bus).mkdir(parents=True)
        (sysfs / "bus/pci/devices" / bus / "numa_node").write_text(numa + "\n")
    assert node.device_numa_node("0000:3b:00.0", sysfs) == 1
    assert node.device_numa_node("0000:5e:00.0", sysfs) == -1  # the selftest shows it: the platform does not say
    assert node.device_numa_node("0000:18:00.0", sysfs) is None


def test_the_report_says_how_torch_openmp_team_spins_by_each_setting() -> None:
    """libgomp's rules as docs/host-step.md measures them: GOMP_SPINCOUNT first, then OMP_WAIT_POLICY, then 300000."""
    spin = environment.openmp_spin
    assert spin("libgomp", 1, {"OMP_WAIT_POLICY": "ACTIVE"}).startswith("no team")
    assert "300000 pauses" in spin("libgomp", 2, {})
    assert spin("libgomp", 2, {"OMP_WAIT_POLICY": "passive"}).startswith("sleeps at once")
    assert spin("libgomp", 2, {"GOMP_SPINCOUNT": "0", "OMP_WAIT_POLICY": "ACTIVE"}).startswith("sleeps at once")
    assert spin("libgomp", 2, {"GOMP_SPINCOUNT": "30k"}) == "spins for 30000 pauses (GOMP_SPINCOUNT)"
    assert spin("libgomp", 2, {"GOMP_SPINCOUNT": "INFINITE"}).startswith("spins until the next region")
    assert "300000 pauses" in spin("libgomp", 2, {"GOMP_SPINCOUNT": "lots"})  # ignored, as libgomp ignores it
    assert spin("libgomp", 2, {"OMP_WAIT_POLICY": "ACTIVE"}).startswith("spins until the next region")
    assert spin("libiomp5", 2, {}) == "spins for 200 ms (KMP_BLOCKTIME unset)"
    assert spin(None, 2, {}) == "unknown runtime: not read"


def test_the_report_names_the_openmp_runtime_torch_loaded(tmp_path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/python3/site-packages/torch.libs/libgomp-a34b3233.so.1.0.0\n")
    assert environment._openmp_runtime(str(maps)) == "libgomp"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /opt/intel/lib/libiomp5.so\n")
    assert environment._openmp_runtime(str(maps)) == "libiomp5"
    assert environment._openmp_runtime(str(tmp_path / "absent")) is None
    threads = torch.get_num_threads()
    env = environment.environment(torch.device("cpu"))
    report, cores = env["torch_openmp"], env["cores_available"]
    assert report["threads"] == threads and cores == len(os.sched_getaffinity(0))
    assert report["after_each_region"] == environment.openmp_spin(report["runtime"], threads, dict(os.environ), cores)


def test_the_report_says_libgomp_throttles_its_spin_with_more_threads_than_cpus() -> None:
    """libgomp's env.c: more of its threads than CPUs caps the spin at 100 pauses (1000 ACTIVE, 0 PASSIVE)."""
    spin = environment.openmp_spin
    assert "300000 pauses" in spin("libgomp", 4, {}, cpus=4)  # as many threads as CPUs: not throttled
    assert spin("libgomp", 4, {}, cpus=2) == "spins for 100 pauses (4 threads on 2 CPUs: libgomp throttles its spin)"
    assert spin("libgomp", 4, {"OMP_WAIT_POLICY": "ACTIVE"}, cpus=2).startswith("spins for 1000 pauses")
    assert spin("libgomp", 4, {"OMP_WAIT_POLICY": "PASSIVE"}, cpus=2).startswith("sleeps at once")
    assert spin("libgomp", 4, {"GOMP_SPINCOUNT": "50"}, cpus=2).startswith("spins for 50 pauses")
    assert spin("libgomp", 4, {"GOMP_SPINCOUNT": "INFINITE"}, cpus=2).startswith("spins for 100 pauses")
    assert spin("libiomp5", 4, {}, cpus=2) == "spins for 200 ms (KMP_BLOCKTIME unset)"  # libgomp's rule only
