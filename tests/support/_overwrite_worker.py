"""A process that replaces one checkpoint over and over (``overwrite=True``), for tests/test_checkpoint_races.py.

    python _overwrite_worker.py PATH STOP_FILE MAX_SAVES [READY_FILE]

Save ``i`` (1, 2, ...) holds the value ``i`` everywhere a load could read it: every model entry, every
optimizer state (moments and step count), the recorded step, ``extra["id"]`` and the tensor
``extra["t"]``, so a load that mixes two saves is seen in its result. Runs until STOP_FILE exists or
MAX_SAVES saves are done, creating READY_FILE after its first save;
prints the number of saves. ``OFFLOAD_ADAMW_CHECKPOINT_EXCHANGE=0`` in the
environment selects the two-rename publication.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from offload_adamw import OffloadAdamW, checkpoint

WIDTH = 192  # three files of about 0.3, 0.6 and 0.01 MB: reading and hashing them takes a while


def build() -> tuple[torch.nn.Module, OffloadAdamW]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, WIDTH))
    optimizer = OffloadAdamW(model.named_parameters(), lr=1e-3, pin_memory=False)
    model(torch.ones(1, WIDTH)).sum().backward()
    optimizer.step()  # creates every state
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def fill(model: torch.nn.Module, optimizer: OffloadAdamW, value: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                optimizer.state[p][key].fill_(value)


def main(path: Path, stop: Path, max_saves: int, ready: Path | None) -> int:
    torch.set_num_threads(1)
    model, optimizer = build()
    saves = 0
    while saves < max_saves and not stop.exists():
        saves += 1
        fill(model, optimizer, saves)
        extra = {"id": saves, "t": torch.full((WIDTH,), float(saves))}
        checkpoint.save(path, model, optimizer, extra=extra, step=saves, overwrite=True, rng=False)
        if ready is not None and saves == 1:
            ready.touch()
    print(saves)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]) if len(sys.argv) > 4 else None))
