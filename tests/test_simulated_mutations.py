"""Proof that the simulated CUDA device bites: delete one wait of the pipeline or of its lane, and a named test fails.

Each mutation removes one wait, record or event (or moves a host read before its wait) in a copy of the sources;
the named tests (tests/test_simulated_lane.py, tests/test_simulated_suites.py, and a few others) then run on that copy in a
subprocess and must fail with a test failure, not a collection error, while the same tests pass on the unmutated
copy. Marked slow: each mutation is a fresh interpreter (about half a minute); run with
``pytest -m slow tests/test_simulated_mutations.py``.

NOT_CAUGHT lists the waits no test catches, each with its reason; it is empty, and a quick test keeps it so. Every
wait it used to list is caught now that the simulated device's host runs ahead of its compute streams (a compute
stream's wait is the device's, not the host's; late kernels and late gradients, offload_adamw.testing.simulated_cuda),
or was restructured away: the early updates' copies come back in the records ``BackwardUpdater.finish()`` returns,
so the step cannot take them before the worker has ended.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACCEL = "offload_adamw/accel"

PARITY = "tests/test_simulated_suites.py::test_parity_table_on_the_simulated_device"
PARITY_FREED = f"{PARITY}[fp32-acc4-freed-clip-scaler_none-seed12]"
PARITY_KEPT = f"{PARITY}[fp32-acc1-kept-noclip-scaler_none-seed11]"
UIB = "tests/test_simulated_suites.py::test_updates_during_backward_on_the_simulated_device[acc1-noclip-seed21]"
SCALER = "tests/test_simulated_suites.py::test_loss_scaling_and_torch_clipping_on_the_simulated_device"
RING = "tests/test_simulated_suites.py::test_the_ring_on_the_simulated_device[buffers2-seed91]"
PLACED = ("tests/test_simulated_suites.py::test_placements_on_the_simulated_device"
          "[stream+device-fp32-acc4-freed-clip-scaler_none-seed81]")

LANE_TESTS = "tests/test_simulated_lane.py::"
SUITES = "tests/test_simulated_suites.py::"
TRANSFER = f"{ACCEL}/transfer.py"
DDP_SUITE = "tests/test_simulated_suites.py::test_distributed_suites_on_the_simulated_device[ddp]"

#: the stream lane's waits, records and events, one mutation each: name -> as MUTATIONS
LANE: dict[str, tuple[str, str, str, list[str]]] = {
    "lane: a copy to the host does not wait for the stream that produced its source (wait_stream)": (
        TRANSFER, "        self.d2h.wait_stream(self._compute())  # the work that produced src\n", "",
        [LANE_TESTS + "test_a_copy_to_the_host_waits_for_the_compute_that_produced_its_source"]),
    "lane: a copy to the host does not record its source on the copy stream (record_stream)": (
        TRANSFER, "has read it.\n        self.backend.record_stream(src, self.d2h)\n", "has read it.\n",
        [LANE_TESTS + "test_a_temporary_source_is_kept_until_its_copy_has_read_it[one]"]),
    "lane: the copies of an update do not wait for the stream that wrote them (wait_stream)": (
        TRANSFER, "        self.d2h.wait_stream(self._compute())  # the update that wrote the sources\n", "",
        [LANE_TESTS + "test_copies_of_an_update_to_the_host_wait_for_the_compute_that_wrote_them"]),
    "lane: the copies of an update do not record their sources (record_stream)": (
        TRANSFER, "            self.backend.record_stream(src, self.d2h)\n", "            pass\n",
        [LANE_TESTS + "test_a_temporary_source_is_kept_until_its_copy_has_read_it[all]"]),
    "lane: a send does not wait for the copy that still reads its destination (wait_event)": (
        TRANSFER, "            self.h2d.wait_event(after.event)  # the device waits, not the host\n", "            pass\n",
        [LANE_TESTS + "test_a_send_into_a_buffer_waits_for_the_copy_that_still_reads_it", RING]),
    "lane: sends do not wait for the compute that still reads the parameters (wait_stream)": (
        TRANSFER, "        self.h2d.wait_stream(self._compute())  # the parameters the device still reads\n",
        "        pass\n", [LANE_TESTS + "test_sends_wait_for_the_compute_that_still_reads_the_parameters"]),
    "lane: the compute stream does not wait for a send (wait_event)": (
        TRANSFER, "            self._compute().wait_event(completion.event)\n", "            pass\n",
        [LANE_TESTS + "test_the_compute_stream_waits_for_a_send_before_reading_it", PARITY_KEPT]),
    "lane: no event is recorded after a copy (event record)": (
        TRANSFER, "        event.record(stream)\n", "",
        [LANE_TESTS + "test_a_copy_lands_late_into_a_poisoned_buffer", PARITY_FREED]),
    "lane: a mark is not an event on the current stream (event record)": (
        TRANSFER, "        return self._event(self._compute())\n", "        return DONE\n",
        [LANE_TESTS + "test_a_mark_completes_after_the_compute_issued_before_it"]),
    "lane: synchronize does not wait for the copies to the host": (
        TRANSFER, "        self.d2h.synchronize()\n", "",
        [LANE_TESTS + "test_page_locked_memory_is_unlocked_only_after_the_copies_that_touch_it"]),
    "lane: synchronize does not wait for the sends": (
        TRANSFER, "        self.h2d.synchronize()\n", "",
        [LANE_TESTS + "test_page_locked_memory_is_unlocked_only_after_the_copies_that_touch_it"]),
    "engine: worker threads do not make the pipeline's device current (thread set-up)": (
        TRANSFER, "            backend, index = self._home\n            backend.set_device(index)\n",
        "            pass\n", [LANE_TESTS + "test_worker_threads_make_the_pipelines_device_current", UIB]),
    "engine: DDP's callback thread runs without the pipeline's device current": (
        f"{ACCEL}/streams.py", "    if before != index:\n        backend.set_device(index)\n    try:",
        "    try:", [DDP_SUITE]),
    "arena: host memory unlocked from the current device of whichever thread frees it (N9)": (
        f"{ACCEL}/host_memory.py",
        "            if before is not None and before != index:\n                backend.set_device(index)\n", "",
        [LANE_TESTS + "test_page_locked_memory_is_locked_and_unlocked_from_its_own_device_on_any_thread"]),
    "arena: host memory unlocked without waiting for the copies that touch it": (
        f"{ACCEL}/host_memory.py", "            locker.synchronize()\n", "",
        [LANE_TESTS + "test_page_locked_memory_is_unlocked_only_after_the_copies_that_touch_it"]),
}

HAZARDS = "tests/test_simulated_hazards.py::"
STEADY = HAZARDS + "test_the_steady_state_step_issues_no_hidden_synchronisation"
SCALE = HAZARDS + "test_the_loss_scale_reaches_the_device_without_a_hidden_synchronisation"

#: issue 41's hazards N4, N5, N7, N8, N9: each fix removed, and the test of tests/test_simulated_hazards.py that catches it
HAZARDS_N: dict[str, tuple[str, str, str, list[str]]] = {
    "N5: a device gradient clipped by a copy of the host coefficient (a blocking copy per parameter on CUDA)": (
        f"{ACCEL}/gate.py", "            return self._on_device[1]\n", "            return host.to(device)\n",
        [HAZARDS + "test_clipped_device_gradients_are_multiplied_by_the_devices_own_coefficient[stream]"]),
    "N9: the ranks' decision flag on the calling thread's current device": (
        "offload_adamw/distributed/dtensor.py", "        return home\n", "        return torch.device(device_type)\n",
        [HAZARDS + "test_the_ranks_flag_lives_on_the_ranks_own_device_not_the_threads_current_one"]),
    "N4: the gate reads a CPU-offloaded gradient's norm before FSDP2's copy into it has landed": (
        f"{ACCEL}/gate.py", "        self._engine.host_gradient_landed(local_tensor(grad))", "        pass",
        [HAZARDS + "test_the_gate_reads_a_cpu_offloaded_gradient_only_after_fsdp2s_copy_landed_with_no_device_wide_sync"]),
    "N7: the wait for FSDP2's copy synchronises the whole device": (
        TRANSFER, "        wait_for_current_stream(backend, index)\n", "        backend.synchronize_device(index)\n",
        [HAZARDS + "test_the_gate_reads_a_cpu_offloaded_gradient_only_after_fsdp2s_copy_landed_with_no_device_wide_sync"]),
    "N9: the wait for FSDP2's copy runs on the calling thread's current device": (
        TRANSFER, "        index = (self._home[1] if self._home is not None\n"
        "                 else self._offload_index if self._offload_index is not None else backend.get_device())\n",
        "        index = backend.get_device()\n",
        [HAZARDS + "test_the_wait_for_a_cpu_offloaded_gradient_runs_on_the_pipelines_device_from_any_thread"]),
    "N8: backward's end does not wait for the early updates' kernels (the resident widening buffer's order)": (
        f"{ACCEL}/schedule.py", "                self._engine.compute_waits(device, done)\n", "                pass\n",
        [HAZARDS + "test_the_resident_widening_buffer_is_ordered_between_the_updater_and_the_main_thread",
         "tests/test_update_in_backward_changes.py::test_an_edit_of_an_accelerator_parameter_between_backward_and_step"
         "_is_refused_every_time[p.data clamp-device]"]),
    "N5: the step counts go to the device from pageable memory (.to(device))": (
        "offload_adamw/kernels/fused_device.py",
        "(stacked.to(device) if to_device is None else to_device(stacked))", "stacked.to(device)",
        [STEADY + "[stream-kept-noclip]", STEADY + "[device-uib-clip]"]),
    "N5: the loss scale goes to a resident group's device from pageable memory": (
        f"{ACCEL}/device_update.py", "scale.to(device) if send is None else send(scale)", "scale.to(device)",
        [SCALE + "[mix-kept-step]"]),  # beside host groups the scale is a host copy (alone it stays on the device)
    "N5: step() reads the loss scale to the host also without host groups": (
        f"{ACCEL}/amp.py", '"cpu" if host_groups else grad_scale.device', '"cpu"', [SCALE + "[stream-kept-step]"]),
    "N5: the unscale's host flag goes to the device from pageable memory": (
        f"{ACCEL}/amp.py", "host_found.to(found_inf.device) if to_device is None else to_device(host_found)",
        "host_found.to(found_inf.device)", [SCALE + "[mix-freed-unscale]"]),
    "N5: the kernels do not wait for a small tensor's copy to the device (the lane's to_device)": (
        TRANSFER, "        compute.wait_event(landed.event)  # a no-op on CUDA", "        pass  # ", [PLACED]),
}

#: name -> (module under src/, the text removed or changed, its replacement, the tests that must catch it)
MUTATIONS: dict[str, tuple[str, str, str, list[str]]] = {
    "slot: no wait for the copy into the host gradient": (
        f"{ACCEL}/slots.py", "        self.landing.wait()\n", "", [PARITY_FREED, PARITY_KEPT]),
    "slot: no wait for the accumulation add": (
        f"{ACCEL}/slots.py", "        self.adding.wait()\n", "", [PARITY_FREED]),
    "accumulator: adds before the copy of the addend landed": (
        f"{ACCEL}/transfer.py", "            after.wait()  # the copy into src has landed\n", "", [PARITY_FREED]),
    "freed: the accumulation buffer reused with its add pending": (
        f"{ACCEL}/residency.py", "        slot.adding.wait()  # the accumulation buffer is about to be overwritten\n", "",
        [SUITES + "test_host_accumulation_with_a_late_accumulator_on_the_simulated_device", PARITY_FREED]),
    "host update: staging written again before the previous copy out of it ended (slot.sending.wait())": (
        f"{ACCEL}/host_update.py", "                    slot.sending.wait()  # the previous copy out of staging has ended\n",
        "", [LANE_TESTS + "test_a_second_step_without_backward_waits_for_the_first_steps_sends_before_it_writes_staging"]),
    "backward's last callback does not wait for the updates handed to the worker (DuringBackward._settle)": (
        f"{ACCEL}/schedule.py", "        updater.settle()\n", "",
        ["tests/test_update_in_backward_changes.py::"
         "test_an_edit_right_after_backward_is_refused_while_the_updates_still_wait_for_their_copies"]),
    "step: an early update's error does not surface at step() (BackwardUpdater.finish)": (
        f"{ACCEL}/overlap.py", "        if error is not None:\n            raise error\n", "",
        ["tests/test_overlap_updater.py::test_the_first_error_of_an_update_is_raised_by_finish"]),
    "device grads: an early update does not wait for the gradient's stream (DeviceGradients.landed)": (
        f"{ACCEL}/device_grads.py", "        self._engine.current_stream_waits(grad.device, slot.landing)\n", "",
        [SUITES + "test_an_update_during_backward_waits_for_the_stream_that_produced_its_device_gradient[stream-seed96]",
         SUITES + "test_an_update_during_backward_waits_for_the_stream_that_produced_its_device_gradient[device-seed97]"]),
    "resident: the next forward does not wait for an early update's kernels (DeviceUpdate.run's mark)": (
        f"{ACCEL}/device_update.py", "                sent.append((device, self._engine.mark(device)))\n", "",
        [SUITES + "test_the_next_forward_waits_for_the_parameters_an_update_during_backward_wrote[device-seed99]"]),
    "stream: the next forward does not wait for an early update's kernels (StreamUpdate.run's mark)": (
        f"{ACCEL}/stream_update.py", "                sent.append((device, self._engine.mark(device)))\n", "",
        [SUITES + "test_the_next_forward_waits_for_a_streamed_parameter_written_back_after_its_update[100]"]),
    "freed: a reduced DDP bucket copied into a gradient an add still writes (land_reduced)": (
        f"{ACCEL}/residency.py",
        "        slot.complete()\n        slot.landing = self._engine.copy_to_host(grad, host)\n",
        "        slot.landing = self._engine.copy_to_host(grad, host)\n",
        [LANE_TESTS + "test_a_reduced_bucket_replaces_a_host_gradient_only_once_the_add_queued_into_it_has_ended"]),
    "step: the next forward does not wait for the parameters sent back": (
        f"{ACCEL}/transport.py", "                front.engine.compute_waits(device, done)\n", "                pass\n",
        [PARITY_KEPT]),
    "step: a step that raised midway returns with earlier buckets' state still landing in host memory": (
        f"{ACCEL}/transport.py", "        finally:\n            # Also when a bucket raised",
        "        except BaseException:\n            raise\n        else:\n            # Also when a bucket raised",
        [SUITES + "test_a_step_that_raises_midway_leaves_no_copy_into_host_memory_in_flight[98]"]),
    "kept: the host reads a gradient before its copy landed": (
        f"{ACCEL}/residency.py", "        slot.complete()\n        slot.fetched = None\n        return slot.host_grad\n",
        "        slot.fetched = None\n        return slot.host_grad\n", [PARITY_KEPT]),
    "early update: reads the landed gradient before its copy ended": (
        f"{ACCEL}/residency.py",
        "        slot.complete()\n        assert slot.host_grad is not None  # the hook or the communication hook",
        "        assert slot.host_grad is not None  # the hook or the communication hook", [UIB]),
    "p.grad's stand-in: torch's clipping and GradScaler read the host gradient before its copy ended": (
        f"{ACCEL}/residency.py", "        with self._lock:\n            slot.complete()\n        assert slot.host_grad",
        "        assert slot.host_grad", [SCALER]),
    "ring: a buffer refilled before its copy out of the previous chunk has read it": (
        f"{ACCEL}/stream_update.py", "pairs(c), after=ring.free[buffer(c)])", "pairs(c))", [RING]),
    "ring: a chunk updated before its copy in has landed": (
        f"{ACCEL}/stream_update.py", "            self._engine.compute_waits(device, inbound.pop(c))",
        "            inbound.pop(c)", [RING]),
    "stream: step() returns before the streamed state is back in host memory": (
        f"{ACCEL}/stream_update.py", "        for done in pending:\n            done.wait()",
        "        for done in pending:\n            pass", [RING, PLACED]),
    **LANE,
    **HAZARDS_N,
}

#: waits of the pipeline (none of the lane's) that the simulated device cannot catch, or that an earlier wait covers, and why
NOT_CAUGHT: dict[str, str] = {}


def test_every_wait_is_caught() -> None:
    assert NOT_CAUGHT == {}, "a wait no test catches: make the hazard real on the simulated device, or restructure"


def _run(src: Path, tests: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(src))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )


def _copy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return src


@pytest.mark.slow
def test_the_unmutated_pipeline_passes_every_test_the_mutations_use(tmp_path) -> None:
    tests = sorted({t for *_, ts in MUTATIONS.values() for t in ts})
    proc = _run(_copy(tmp_path), tests)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_removing_a_wait_fails_a_simulated_device_suite(name: str, tmp_path) -> None:
    module, old, new, tests = MUTATIONS[name]
    src = _copy(tmp_path)
    path = src / module
    text = path.read_text()
    assert text.count(old) == 1, f"the mutation of {module} no longer matches the code exactly once: update it"
    path.write_text(text.replace(old, new))
    proc = _run(src, tests)
    assert proc.returncode == 1, (
        f"{name}: expected a test failure (exit 1), got {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"
    )
