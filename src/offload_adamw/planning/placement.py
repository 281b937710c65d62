"""Where each parameter group's update runs, and the mix of placements the planner chooses.

Contract:

* Pure computation on plain numbers: no torch import, no I/O.
* A placement is a value of OffloadAdamW's per-group ``update_on`` (:data:`PLACEMENTS`): ``"host"``
  (the host update: the gradient comes down, round(master) goes up), ``"stream"`` (float32 master,
  m and v in pinned host memory, streamed through a ring of device buffers for torch's fused AdamW
  on the device; the gradient never leaves the device) or ``"device"`` (the state lives on the
  device). :func:`placement_costs` gives, per element a rank holds, the bytes each placement costs
  in device memory, host memory, over PCIe each way, in host memory traffic and in device memory
  traffic; a placement's cost is linear in the elements it holds, plus a step count per tensor
  and, for ``"stream"``, the ring once.
* :func:`planning_groups` cuts a model's named tensors into the groups a placement is chosen for:
  one per decoder layer (names ``...layers.N.``, ``...h.N.``, ``...blocks.N.``) and one per other
  tensor, each with the elements one rank holds under FSDP2 (dim 0 padded to the world size) and a
  pattern of :func:`offload_adamw.named_param_groups` that selects exactly its parameters.
* :func:`choose_mix` returns, for each value of ``offload_gradients``, the assignment of a placement
  to every group whose step-time bound (the slowest link: PCIe each way, host memory, device
  memory) is the smallest among all assignments that fit device and host memory; ties go to the
  larger device-memory margin. Groups of the same elements and tensor count are interchangeable,
  so the search runs over how many of each kind take each placement: exhaustively for every kind
  but the most numerous, and for that one over its resident count, with its streamed count taken
  among the breakpoints of the bound (a maximum of lines in that count, so its minimum over an
  interval of integers lies at an end or next to a crossing of two lines). Within a kind the first
  groups in model order stay resident (their gradients come last in backward, so the update left
  after backward is the fastest), the next are streamed, the rest go to the host.
* :meth:`Mix.param_group_rules` prints the choice as the ``named_param_groups`` rules to pass: one
  rule per placement other than the default one, layers written as ranges of indices.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from offload_adamw.contract import bills

__all__ = [
    "PLACEMENTS",
    "PlacementCost",
    "PlanningGroup",
    "Limits",
    "Mix",
    "placement_costs",
    "shard_numel",
    "planning_groups",
    "index_range_regex",
    "evaluate",
    "choose_mix",
]

#: OffloadAdamW's ``update_on`` values, in the order the planner prints them.
PLACEMENTS = ("device", "stream", "host")
#: bytes of one tensor's step count (a float32 0-dim tensor): on the device for a resident group, else on the host.
STEP_BYTES = bills.STEP_COUNT_BYTES
#: at most this many assignments of the kinds other than the most numerous are tried; past it the smallest
#: kinds are merged into one group (the default group of the rules).
_MAX_OTHER_ASSIGNMENTS = 400


@dataclass(frozen=True)
class PlacementCost:
    """What one element (of one rank's shard) costs in one placement, per training step."""

    gpu_bytes: int
    """Device memory held: the gradient where it stays on the device, the state where it lives there."""
    host_bytes: int
    """Host memory held (per rank): the state, and the landing buffers of gradients that come down."""
    h2d: int
    """Host-to-device bytes."""
    d2h: int
    """Device-to-host bytes."""
    host_traffic: int
    """Bytes read plus written in host memory (updates on the host, DMA in and out)."""
    gpu_traffic: int
    """Bytes read plus written in device memory by the update (and by the streamed state)."""


def state_bytes_per_element(*, amsgrad: bool) -> int:
    """float32 master, m and v (and max_v) of a parameter on a device: docs/contract.md#memory-bill, 12 or 16."""
    one = bills.tensor_state_bytes(1, "bfloat16", on_host=False, amsgrad=amsgrad)
    return one.moments + one.master


def placement_costs(*, param_bytes: int, grad_bytes: int, amsgrad: bool, grad_accumulation: int,
                    offload_gradients: bool) -> dict[str, PlacementCost]:
    """Per-element costs of each placement (see the module contract).

    ``host``: the 28-byte single-pass update (36 with AMSGrad, docs/contract.md#traffic-bill) plus the
    gradient's DMA in and the parameter's DMA out; with ``offload_gradients`` the device gradient is
    transient and every micro-batch's gradient comes down and is accumulated on the host (4 bytes of
    traffic per gradient byte per extra micro-batch, an accumulation buffer beside the host gradient); its host
    bytes include the staging copy (``param_bytes``) the updated parameter is sent back from.
    ``stream``: the state up and back (12 or 16 bytes each way), the same update on the device plus the
    ring's writes and reads; the gradient and the parameter stay on the device. ``device``: the update
    on the device only.
    """
    state = state_bytes_per_element(amsgrad=amsgrad)
    update = 28 + (8 if amsgrad else 0)
    p, g, accum = param_bytes, grad_bytes, grad_accumulation
    if offload_gradients:
        host = PlacementCost(gpu_bytes=0, host_bytes=state + g * (2 if accum > 1 else 1) + p, h2d=p, d2h=accum * g,
                             host_traffic=g + (accum - 1) * 4 * g + update + p, gpu_traffic=0)
    else:
        host = PlacementCost(gpu_bytes=g, host_bytes=state + g + p, h2d=p, d2h=g, host_traffic=g + update + p,
                             gpu_traffic=0)
    return {
        "host": host,
        "stream": PlacementCost(gpu_bytes=g, host_bytes=state, h2d=state, d2h=state, host_traffic=2 * state,
                                gpu_traffic=update + 2 * state),
        "device": PlacementCost(gpu_bytes=g + state, host_bytes=0, h2d=0, d2h=0, host_traffic=0, gpu_traffic=update),
    }


# --------------------------------------------------------------------------- groups


def shard_numel(shape: tuple[int, ...], world: int, rank: int = 0) -> int:
    """Elements rank ``rank`` holds of a tensor that FSDP2 shards on dim 0: chunks of ``ceil(rows / world)`` rows
    (torch.chunk), so rank 0 holds the largest (padded to a multiple of ``world``)."""
    if not shape:
        return 1
    chunk = math.ceil(shape[0] / world)
    return max(0, min(chunk, shape[0] - rank * chunk)) * math.prod(shape[1:])


_LAYER_CONTAINERS = ("layers", "h", "blocks")


@dataclass(frozen=True)
class PlanningGroup:
    """Parameters that take one placement together."""

    label: str
    """``model.layers.7`` for a decoder layer, the tensor's name otherwise."""
    elements: int
    """Elements one rank holds (its FSDP2 shards)."""
    tensors: int
    """Parameter tensors in the group (one step count each)."""
    names: tuple[str, ...]
    """The parameter names of the group."""
    layer: tuple[str, int] | None = None
    """(container prefix, index) for a decoder layer: ``("model.layers", 7)``."""


def planning_groups(shapes: Iterable[tuple[str, tuple[int, ...]]], world: int) -> list[PlanningGroup]:
    """One group per decoder layer and one per other tensor, in the order the names first appear."""
    order: list[str] = []
    members: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    layers: dict[str, tuple[str, int]] = {}
    for name, shape in shapes:
        parts = name.split(".")
        key = name
        for k in range(len(parts) - 1):
            if parts[k] in _LAYER_CONTAINERS and parts[k + 1].isdigit():
                key = ".".join(parts[: k + 2])
                layers[key] = (".".join(parts[: k + 1]), int(parts[k + 1]))
                break
        if key not in members:
            order.append(key)
            members[key] = []
        members[key].append((name, tuple(shape)))
    return [
        PlanningGroup(label=key, elements=sum(shard_numel(s, world) for _, s in members[key]), tensors=len(members[key]),
                      names=tuple(n for n, _ in members[key]), layer=layers.get(key))
        for key in order
    ]


def index_range_regex(low: int, high: int) -> str:
    """A regex alternation that matches, in full, exactly the decimal integers ``low..high`` (no leading zeros)."""
    if not 0 <= low <= high:
        raise ValueError(f"index range {low}..{high} is empty or negative")
    parts: list[str] = []
    start = low
    while start <= high:
        stop = min(high, 10 ** len(str(start)) - 1)  # the same number of digits
        parts.extend(_same_length(str(start), str(stop)))
        start = stop + 1
    return "|".join(parts)


def _digits(a: str, b: str) -> str:
    return a if a == b else f"[{a}-{b}]"


def _same_length(low: str, high: str) -> list[str]:
    """Patterns without alternation inside, one of which matches each number of ``low..high`` (equal lengths)."""
    if low == high:
        return [low]
    if len(low) == 1:
        return [_digits(low, high)]
    if low[0] == high[0]:
        return [low[0] + rest for rest in _same_length(low[1:], high[1:])]
    width = len(low) - 1
    parts: list[str] = []
    first, last = int(low[0]), int(high[0])
    if low[1:] != "0" * width:
        parts += [low[0] + rest for rest in _same_length(low[1:], "9" * width)]
        first += 1
    tail = []
    if high[1:] != "9" * width:
        tail = [high[0] + rest for rest in _same_length("0" * width, high[1:])]
        last -= 1
    if first <= last:
        parts.append(_digits(str(first), str(last)) + "[0-9]" * width)
    return parts + tail


def _name_regex(name: str) -> str:
    return r"re:(?:^|\.)" + re.escape(name) + "$"


def _layers_regex(prefix: str, indices: Sequence[int]) -> str:
    ranges: list[tuple[int, int]] = []
    for i in sorted(indices):
        if ranges and i == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], i)
        else:
            ranges.append((i, i))
    alternation = "|".join(index_range_regex(a, b) for a, b in ranges)
    return r"re:(?:^|\.)" + re.escape(prefix) + r"\.(?:" + alternation + r")\."


# --------------------------------------------------------------------------- evaluating and choosing


@dataclass(frozen=True, kw_only=True)
class Limits:
    """The machine and the fixed bills a mix is placed into (one rank's GPU, one node's host memory)."""

    gpu_fixed_bytes: int
    """Device memory every mix holds: parameters, activations, FSDP buffers, the reserve."""
    gpu_capacity: float
    """Memory of one GPU."""
    host_fixed_bytes: int
    """Host memory of a node every mix holds: the reserve."""
    host_capacity: float
    """Host memory of one node."""
    ranks_per_node: int
    """Ranks sharing one node's host memory and its bandwidth."""
    ring_bytes: int
    """Device buffers of the streamed state (the ring), held once when any group is streamed."""
    pcie_bytes_per_s: float
    """Host<->device bandwidth per GPU and direction."""
    host_memory_bytes_per_s: float
    """Host memory bandwidth of a node."""
    gpu_memory_bytes_per_s: float
    """Device memory bandwidth of one GPU."""


@dataclass(frozen=True, kw_only=True)
class Totals:
    """Elements and tensors per placement, and what they cost."""

    elements: dict[str, int]
    """Elements per placement (one rank)."""
    tensors: dict[str, int]
    """Tensors per placement."""
    gpu_bytes: int
    """Device memory of one GPU, fixed bills included."""
    host_bytes: int
    """Host memory of one node, fixed bills included."""
    h2d: int
    """Host-to-device bytes per GPU and step."""
    d2h: int
    """Device-to-host bytes per GPU and step."""
    host_traffic: int
    """Host memory traffic per node and step."""
    gpu_traffic: int
    """Device memory traffic per GPU and step."""
    times: dict[str, float]
    """Seconds per link: ``pcie h2d``, ``pcie d2h``, ``host memory``, ``gpu memory``."""
    fits: bool
    """Within both capacities."""

    @property
    def bound_s(self) -> float:
        """The optimizer step's lower bound: the slowest link."""
        return max(self.times.values())

    @property
    def bottleneck(self) -> str:
        """The link that sets the bound (``pcie`` for either direction)."""
        name = max(self.times, key=lambda k: self.times[k])
        return "pcie" if name.startswith("pcie") else name


def evaluate(elements: dict[str, int], tensors: dict[str, int], costs: dict[str, PlacementCost], limits: Limits) -> Totals:
    """What an assignment with these elements and tensors per placement costs (see the module contract)."""
    e = {x: elements.get(x, 0) for x in PLACEMENTS}
    t = {x: tensors.get(x, 0) for x in PLACEMENTS}
    streamed = e["stream"] > 0 or t["stream"] > 0
    gpu = (limits.gpu_fixed_bytes + sum(costs[x].gpu_bytes * e[x] for x in PLACEMENTS) + STEP_BYTES * t["device"]
           + (limits.ring_bytes if streamed else 0))
    host = limits.host_fixed_bytes + limits.ranks_per_node * (
        sum(costs[x].host_bytes * e[x] for x in PLACEMENTS) + STEP_BYTES * (t["host"] + t["stream"]))
    h2d = sum(costs[x].h2d * e[x] for x in PLACEMENTS)
    d2h = sum(costs[x].d2h * e[x] for x in PLACEMENTS)
    host_traffic = limits.ranks_per_node * sum(costs[x].host_traffic * e[x] for x in PLACEMENTS)
    gpu_traffic = sum(costs[x].gpu_traffic * e[x] for x in PLACEMENTS)
    times = {
        "pcie h2d": h2d / limits.pcie_bytes_per_s,
        "pcie d2h": d2h / limits.pcie_bytes_per_s,
        "host memory": host_traffic / limits.host_memory_bytes_per_s,
        "gpu memory": gpu_traffic / limits.gpu_memory_bytes_per_s,
    }
    return Totals(elements=e, tensors=t, gpu_bytes=gpu, host_bytes=host, h2d=h2d, d2h=d2h, host_traffic=host_traffic,
                  gpu_traffic=gpu_traffic, times=times, fits=gpu <= limits.gpu_capacity and host <= limits.host_capacity)


@dataclass(frozen=True, kw_only=True)
class Mix:
    """A placement for every group, and what it costs."""

    offload_gradients: bool
    """OffloadAdamW's ``offload_gradients``: the host groups' device gradients are freed after their copy
    (streamed and resident groups keep theirs on the device)."""
    assignment: tuple[tuple[PlanningGroup, str], ...]
    """(group, placement) in model order."""
    totals: Totals
    """The mix's bytes, traffic and link times."""
    default_label: str | None = None
    """The group made of the kinds merged into one (its parameters are the rules' default group), if any."""
    notes: tuple[str, ...] = field(default=())
    """What the search did that a reader should know."""

    def count(self, placement: str) -> int:
        """Groups with this placement."""
        return sum(1 for _, x in self.assignment if x == placement)

    @property
    def uniform(self) -> str | None:
        """The one placement of every group, or None for a mix."""
        used = {x for _, x in self.assignment}
        return next(iter(used)) if len(used) == 1 else None

    def default_placement(self) -> str:
        """The placement of the rules' default group: the merged group's, else the one of the most elements."""
        for group, x in self.assignment:
            if group.label == self.default_label:
                return x
        return max(PLACEMENTS, key=lambda x: (self.totals.elements[x], -PLACEMENTS.index(x)))

    def param_group_rules(self) -> tuple[list[tuple[str, dict[str, str]]], dict[str, str]]:
        """(rules, default) for ``named_param_groups(model, rules, default=default)``: one rule per placement
        other than the default's, listing its layers as index ranges and its other tensors by name."""
        default = self.default_placement()
        rules: list[tuple[str, dict[str, str]]] = []
        for placement in PLACEMENTS:
            if placement == default:
                continue
            layers: dict[str, list[int]] = {}
            names: list[str] = []
            for group, x in self.assignment:
                if x != placement:
                    continue
                if group.layer is not None:
                    layers.setdefault(group.layer[0], []).append(group.layer[1])
                else:
                    names.extend(group.names)
            for name in names:
                rules.append((_name_regex(name), {"update_on": placement}))
            for prefix, indices in layers.items():
                rules.append((_layers_regex(prefix, indices), {"update_on": placement}))
        return rules, {"update_on": default}


@dataclass
class _Kind:
    elements: int
    tensors: int
    groups: list[PlanningGroup]


def _kinds(groups: Sequence[PlanningGroup]) -> tuple[list[_Kind], str | None]:
    by_key: dict[tuple[int, int], _Kind] = {}
    for group in groups:
        key = (group.elements, group.tensors)
        kind = by_key.get(key)
        if kind is None:
            kind = by_key[key] = _Kind(group.elements, group.tensors, [])
        kind.groups.append(group)
    kinds = list(by_key.values())
    merged_label = None
    if len(kinds) > 1:
        big = max(kinds, key=lambda k: (len(k.groups), k.elements))
        others = sorted((k for k in kinds if k is not big), key=lambda k: k.elements * len(k.groups))

        def assignments(ks: Sequence[_Kind]) -> int:
            return math.prod((len(k.groups) + 1) * (len(k.groups) + 2) // 2 for k in ks)

        if assignments(others) > _MAX_OTHER_ASSIGNMENTS:
            # Merge the smallest kinds into one group (one placement for all of them) until the search is small.
            take = 0
            while assignments(others[take:]) * 3 > _MAX_OTHER_ASSIGNMENTS and take < len(others):
                take += 1
            merged = [g for k in others[:take] for g in k.groups]
            merged_label = "the other parameters"
            rest = PlanningGroup(label=merged_label, elements=sum(g.elements for g in merged),
                                 tensors=sum(g.tensors for g in merged), names=tuple(n for g in merged for n in g.names))
            kinds = [big, *others[take:], _Kind(rest.elements, rest.tensors, [rest])]
    return kinds, merged_label


def _splits(n: int) -> list[tuple[int, int]]:
    """(device, stream) counts of a kind of ``n`` groups; the rest go to the host."""
    return [(d, s) for d in range(n + 1) for s in range(n + 1 - d)]


#: (bound, device bytes, host bytes, link times) of one assignment
_Score = tuple[float, int, int, tuple[float, ...]]


class _Scorer:
    """:func:`evaluate` reduced to the numbers the search compares, for one set of costs (the same arithmetic)."""

    def __init__(self, costs: dict[str, PlacementCost], limits: Limits) -> None:
        self.costs, self.limits = costs, limits
        self.rows = [(c.gpu_bytes, c.host_bytes, c.h2d, c.d2h, c.host_traffic, c.gpu_traffic)
                     for c in (costs["device"], costs["stream"], costs["host"])]

    def __call__(self, ed: int, es: int, eh: int, td: int, ts: int, th: int) -> _Score:
        """(bound, device bytes, host bytes, link times) of an assignment with these elements and tensors."""
        (gd, hd, ud, dd, xd, yd), (gs, hs, us, ds, xs, ys), (gh, hh, uh, dh, xh, yh) = self.rows
        lim = self.limits
        gpu = lim.gpu_fixed_bytes + gd * ed + gs * es + gh * eh + STEP_BYTES * td + (lim.ring_bytes if es or ts else 0)
        host = lim.host_fixed_bytes + lim.ranks_per_node * (hd * ed + hs * es + hh * eh + STEP_BYTES * (th + ts))
        times = ((ud * ed + us * es + uh * eh) / lim.pcie_bytes_per_s,
                 (dd * ed + ds * es + dh * eh) / lim.pcie_bytes_per_s,
                 lim.ranks_per_node * (xd * ed + xs * es + xh * eh) / lim.host_memory_bytes_per_s,
                 (yd * ed + ys * es + yh * eh) / lim.gpu_memory_bytes_per_s)
        return max(times), gpu, host, times


#: bounds within this fraction of the smallest are not told apart: among them the simplest mix is chosen.
BOUND_TOLERANCE = 0.01


def choose_mix(groups: Sequence[PlanningGroup], costs_by_flag: dict[bool, dict[str, PlacementCost]],
               limits: Limits) -> Mix | None:
    """The fitting assignment to choose (see the module contract), or None when none fits.

    ``costs_by_flag`` maps ``offload_gradients`` (False, True) to :func:`placement_costs` under it. Among the
    fitting assignments whose bound is within :data:`BOUND_TOLERANCE` of the smallest, the simplest is chosen:
    ``offload_gradients`` off where it can be, then the fewest elements on the host, then the most resident,
    then the larger device-memory margin.
    """
    if not groups:
        return None
    kinds, merged_label = _kinds(groups)
    big_index = max(range(len(kinds)), key=lambda i: (len(kinds[i].groups), kinds[i].elements))
    big = kinds[big_index]
    others = [k for i, k in enumerate(kinds) if i != big_index]
    n, be, bt = len(big.groups), big.elements, big.tensors
    gpu_cap, host_cap = limits.gpu_capacity, limits.host_capacity
    # one line per (flag, split of the other kinds, resident count d of the big kind): the streamed count s
    # that minimises the bound there, and the largest s that fits
    lines: list[tuple[float, bool, tuple[tuple[int, int], ...], int, int, int, Callable[[int], _Score]]] = []
    for flag in sorted(costs_by_flag):
        score = _Scorer(costs_by_flag[flag], limits)
        for other_splits in itertools.product(*(_splits(len(k.groups)) for k in others)):
            ed = es = eh = td = ts = th = 0
            for kind, (kd, ks) in zip(others, other_splits):
                kh = len(kind.groups) - kd - ks
                ed, es, eh = ed + kd * kind.elements, es + ks * kind.elements, eh + kh * kind.elements
                td, ts, th = td + kd * kind.tensors, ts + ks * kind.tensors, th + kh * kind.tensors
            for d in range(n + 1):
                at = _line(score, (ed + d * be, es, eh + (n - d) * be, td + d * bt, ts, th + (n - d) * bt), be, bt)
                # s = 0 (the rest on the host, no ring) is the smallest device footprint at this resident count,
                # and it grows with d: once it does not fit, no larger d fits either
                if at(0)[1] > gpu_cap:
                    break
                fitting = [s for s in _candidates(at, n - d, limits) if at(s)[1] <= gpu_cap and at(s)[2] <= host_cap]
                if fitting:
                    s_min = min(fitting, key=lambda s: (at(s)[0], s))
                    lines.append((at(s_min)[0], flag, other_splits, d, s_min, max(fitting), at))
    if not lines:
        return None
    threshold = min(line[0] for line in lines) * (1 + BOUND_TOLERANCE)
    best: tuple[tuple[float, ...], bool, tuple[tuple[int, int], ...], int, int] | None = None
    for bound, flag, other_splits, d, s_min, s_max, at in lines:
        if bound > threshold:
            continue
        # the bound is convex in s: from its minimum up to the largest fitting s it only grows, so the largest
        # s still within the threshold (fewest on the host) is found by bisection
        lo, hi = s_min, s_max
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if at(mid)[0] <= threshold:
                lo = mid
            else:
                hi = mid - 1
        s = lo
        elements_host = sum((len(k.groups) - kd - ks) * k.elements for k, (kd, ks) in zip(others, other_splits))
        elements_host += (n - d - s) * be
        elements_device = sum(kd * k.elements for k, (kd, _) in zip(others, other_splits)) + d * be
        _, gpu, host, _ = at(s)
        key = (float(flag), float(elements_host), float(-elements_device), gpu - gpu_cap, host - host_cap)
        if best is None or key < best[0]:
            best = (key, flag, other_splits, d, s)
    assert best is not None  # the line of the smallest bound is within the threshold
    _, flag, other_splits, d, s = best
    placed: dict[str, str] = {}
    for kind, (kd, ks) in [*zip(others, other_splits), (big, (d, s))]:
        for index, group in enumerate(kind.groups):
            placed[group.label] = "device" if index < kd else "stream" if index < kd + ks else "host"
    # model order; the merged group (its members are the rules' default group) last
    assignment = [(group, placed[group.label]) for group in groups if group.label in placed]
    notes: tuple[str, ...] = ()
    if merged_label is not None:
        rest = next(g for k in kinds for g in k.groups if g.label == merged_label)
        assignment.append((rest, placed[merged_label]))
        notes = (f"{len(rest.names)} tensors of the smallest kinds take one placement together (the default group)",)
    elements = dict.fromkeys(PLACEMENTS, 0)
    tensors = dict.fromkeys(PLACEMENTS, 0)
    for group, x in assignment:
        elements[x] += group.elements
        tensors[x] += group.tensors
    totals = evaluate(elements, tensors, costs_by_flag[flag], limits)
    return Mix(offload_gradients=flag, assignment=tuple(assignment), totals=totals, default_label=merged_label,
               notes=notes)


def _line(score: _Scorer, base: tuple[int, int, int, int, int, int], elements: int, tensors: int) -> Callable[[int], _Score]:
    """The score of ``base`` (all of the big kind's non-resident groups on the host) with ``s`` of them streamed instead."""
    cache: dict[int, _Score] = {}
    ed, es, eh, td, ts, th = base

    def at(s: int) -> _Score:
        value = cache.get(s)
        if value is None:
            value = cache[s] = score(ed, es + s * elements, eh - s * elements, td, ts + s * tensors, th - s * tensors)
        return value

    return at


def _candidates(at: Callable[[int], _Score], top: int, limits: Limits) -> list[int]:
    """Streamed counts in 0..top among which the best fitting one lies (see the module contract)."""
    if top <= 0:
        return [0]
    points = {0, 1, top - 1, top}
    one, hi = at(1), at(top)
    span = top - 1
    if span == 0:
        return sorted(points)
    # the link times, and the two memories, are exactly linear in s for s >= 1 (the ring is then held)
    lines = [(start, (end - start) / span) for start, end in zip(one[3], hi[3])]
    for (a1, b1), (a2, b2) in itertools.combinations(lines, 2):
        if b1 != b2:
            x = 1 + (a2 - a1) / (b1 - b2)
            if 0 <= x <= top:
                points.update((math.floor(x), math.ceil(x)))
    for capacity, start, end in ((limits.gpu_capacity, one[1], hi[1]), (limits.host_capacity, one[2], hi[2])):
        if end != start:
            x = 1 + (capacity - start) * span / (end - start)
            if -2 <= x <= top + 2:
                points.update(math.floor(x) + k for k in (-1, 0, 1, 2))
    return sorted(p for p in points if 0 <= p <= top)
