"""Compute emulation: pad measured compute up to a hardware profile's latencies.

``go2-paper`` is the FSD paper's Go2 setup (Table 8): 72 ms per draft token on the Jetson,
620 ms per target verification forward, and 354 ms per target single-token decode step in AR
mode (derived from the paper's AR->SD 0.90x with its Table 4 model at T_c 120 ms, gamma 4,
tau 2.92). Early exit i of L becomes available at i/L of the verification time, and every exit
computed costs ``exit_s`` more (its norm + LM head over the block's rows and the host-side check
that streams it; 8 ms is this project's estimate for a 7B target's 152k-vocabulary head, not a
figure from the paper).

The robot has one accelerator: ``EdgeDevice`` makes emulated drafting a serial resource that the
main drafting path, the pipeline and every pre-draft worker share (``edge_units`` > 1 is an
explicitly labelled what-if). Emulated figures must be labelled as such wherever they are shown.

Prefill is emulated on both sides: the cloud's (``prefill_s``, one target prefill of a frame and
the prompt) on the verifier's compute thread, the robot's draft prefill (``edge_prefill_s``) on its
one accelerator. go2-paper takes the cloud's as one verification pass (620 ms) and the robot's as
300 ms: the paper gives neither, so both are this project's estimates, labelled.

A profile may also be a file (``--compute FILE.json``): ``edgespec-profile`` measures one on a GPU
server. Its cloud terms are measured, with the pass time as a table over batch rows and block
length (tokens fed per robot), so a batched pass of the fleet verifier costs what was measured for
that many rows, not a flat one pass.

A profile file may instead carry a published figure (``"label": "LITERATURE"``): a production
engine's cloud-only per-token time, with a ``literature`` block naming the engine, its version, the
model, the GPU, the batch, the figure and its source. Such an engine verifies no robot's drafts:
only cloud AR runs on it (``cloud_only``), each step charged the published time.
"""
from __future__ import annotations

import bisect
import contextlib
import json
import math
import os
import threading
import time
from dataclasses import dataclass, replace


PROFILE_FORMAT = "edgespec-compute/1"
# Limits on a profile file (``--compute FILE``): it is input, so a crafted one must not make the
# emulation charge minutes a pass, crash the loader, or pass a bool or a string off as a number.
MAX_SECONDS = 60.0  # any time a profile states, and any pass time its table can give (extrapolated too)
MAX_EDGE_UNITS = 64  # the largest labelled what-if (go2-paper-multigpu); one per pre-draft worker is plenty
MAX_TABLE_AXIS = 4096  # largest rows or blocks a table may name (the verifier asks <= --max-batch, MAX_BLOCK + 1)
MAX_PROFILE_BYTES = 1 << 20  # a measured profile is a few kB; checked before reading
# A measured table is extended past its last rows (blocks) along its last segment's slope, but only
# up to MAX_EXTRAPOLATION times its last rows (blocks); further out a pass costs the value there.
# Why a cap: a slope measured over a few points says nothing about ten times the range, and a
# small steep table (2 x 2, seconds apart) extended to 64 rows x 65 blocks charges minutes a pass.
# Why 2: it keeps what a table measured to 16 rows says about a 32-row fleet, and within it the
# extension is the same as without a cap. The price: a pass beyond it is charged the value at the
# cap (an under-estimate where time keeps growing), so measure a profile over the rows and blocks
# it is used at. from_dict checks that the table's largest pass time over the whole capped range
# stays within MAX_SECONDS, so a loaded profile can never charge more than that a pass.
MAX_EXTRAPOLATION = 2.0


@dataclass(frozen=True)
class ComputeProfile:
    name: str
    draft_token_s: float = 0.0  # per drafted token on the robot
    verify_s: float = 0.0  # per target verification forward (any gamma; a table's row 1, block 5)
    ar_step_s: float = 0.0  # per target single-token decode step
    exit_s: float = 0.0  # per early exit computed during a verification (LM head + host check)
    edge_units: int = 1  # accelerators on the robot (1: a Jetson; more is a labelled what-if)
    prefill_s: float = 0.0  # the cloud's prefill of one decision's prompt (frame + text)
    edge_prefill_s: float = 0.0  # the robot's draft prefill of the same prompt, on its accelerator
    # measured pass times: (rows, blocks, seconds[rows][blocks]); empty: verify_s / ar_step_s flat
    verify_table: tuple = ()
    source: str = ""  # where the figures come from (a measured profile names its device)
    edge_source: str = ""
    # a shared cloud under load: this many other sessions' rows ride every pass (``with_load``)
    background_rows: int = 0
    label: str = ""  # LITERATURE: a published figure, not a measurement or an emulation of this project's verifier
    literature: tuple = ()  # (key, value) pairs of a LITERATURE profile's block: engine, version, model, gpu, ...

    @property
    def cloud_only(self) -> bool:
        """A production engine's published figure: it serves cloud AR and verifies no robot's drafts."""
        return self.label == LITERATURE

    def literature_field(self, key: str, default=None):
        return dict(self.literature).get(key, default)

    @property
    def emulated(self) -> bool:
        return self.name != "native"

    def pass_s(self, rows: int = 1, block: int = 5, ar: bool = False) -> float:
        """The accelerator's time for one pass that feeds ``block`` tokens (pending + drafts) to
        each of ``rows`` sessions. A measured table is interpolated linearly (past its last rows or
        blocks, the last segment's slope where it grows, up to MAX_EXTRAPOLATION times them and held
        beyond: ``_interp2``); a flat profile charges verify_s per pass whatever its rows (ar_step_s
        for a pass of AR steps only)."""
        if self.verify_table:
            rows_at, blocks_at, table = self.verify_table
            return max(0.0, _interp2(rows_at, blocks_at, table, rows + self.background_rows, block))
        if not self.verify_s:
            return 0.0
        return self.ar_step_s if ar else self.verify_s

    def prefill_for(self, computed: int, total: int) -> float:
        """The cloud's prefill of a ``total``-position prompt of which only ``computed`` positions
        were computed (the rest kept from the session's cache: prefix reuse): ``prefill_s`` in
        proportion (a whole prompt costs ``prefill_s``)."""
        if not self.prefill_s or total <= 0:
            return 0.0
        return self.prefill_s * min(1.0, max(0, computed) / total)

    def verify_total_s(self, exits_computed: int, block: int = 5) -> float:
        """Emulated verification time with ``exits_computed`` early exits evaluated on the way."""
        base = self.pass_s(1, block)
        return base + exits_computed * self.exit_s if base else 0.0

    def exit_available_s(self, exit_layer: int, num_layers: int, exits_before: int = 0,
                         pass_s: float | None = None, exit_rows: int = 1) -> float:
        """When early exit `exit_layer` of `num_layers` is available within a verification
        (``exits_before``: exits computed at shallower layers, each costing exit_s first;
        ``pass_s``: the time of the pass the round rides, default a lone round's; ``exit_rows``:
        the rows of that pass that compute exits, each layer's exits of all of them cost exit_s each)."""
        base = self.pass_s() if pass_s is None else pass_s
        return base * exit_layer / num_layers + max(1, exit_rows) * (exits_before + 1) * self.exit_s if base else 0.0

    def with_robot(self, robot: "RobotProfile | str | None") -> "ComputeProfile":
        """This cloud with another robot's drafting (``ROBOT_PROFILES`` name or a RobotProfile;
        None: unchanged): the draft token time, the draft prefill and their source are the robot's,
        everything of the cloud stays, and the name says both (``cloud+robot``)."""
        if robot is None:
            return self
        r = get_robot(robot) if isinstance(robot, str) else robot
        return replace(self, name=f"{self.name}+{r.name}", draft_token_s=r.draft_token_s,
                       edge_prefill_s=r.edge_prefill_s, edge_units=1, edge_source=r.source)

    def with_load(self, rows: int) -> "ComputeProfile":
        """This cloud shared with other tenants: ``rows`` other sessions' rows ride every pass, each
        feeding the pass's own block (charged from the measured rows x block table, so a lone AR
        step costs a batched one). Prefill and exits are not loaded (a stated simplification).
        ValueError for a flat profile, which has no batch curve to charge the load from."""
        if rows < 0 or rows > MAX_TABLE_AXIS:
            raise ValueError(f"load: 0 <= rows <= {MAX_TABLE_AXIS}, got {rows}")
        if not rows:
            return self
        if not self.verify_table:
            raise ValueError(f"compute profile {self.name!r} has no measured rows x block table: a load of other "
                             "sessions' rows cannot be charged on it (use a measured profile, e.g. an edgespec-profile "
                             "file, or a100-fsd-table9)")
        return replace(self, name=f"{self.name}{LOAD_SUFFIX}{rows}", background_rows=self.background_rows + rows,
                       source=f"{self.source}; LOADED: {rows} other sessions' rows in every pass (this project's "
                              "emulation of a shared server)")

    @classmethod
    def from_dict(cls, d: dict, origin: str = "profile") -> "ComputeProfile":
        """A profile from its JSON form (``edgespec-profile`` writes it); ValueError naming
        ``origin`` and saying what is wrong otherwise. Contract of what it accepts: every time a
        JSON number (not a bool, not a string) of seconds in [0, MAX_SECONDS]; edge_units an
        integer in [1, MAX_EDGE_UNITS]; a table's rows and blocks increasing integers in
        [1, MAX_TABLE_AXIS], one time per (row, block), and the table's pass time, extrapolated
        as ``pass_s`` does over any rows and blocks, never above MAX_SECONDS."""
        if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{origin}: not a compute profile (needs \"format\": \"{PROFILE_FORMAT}\")")
        fields = {}
        for key in ("draft_token_s", "verify_s", "ar_step_s", "exit_s", "prefill_s", "edge_prefill_s"):
            v = d.get(key, 0.0)
            if not _is_seconds(v):
                raise ValueError(f"{origin}: {key} must be seconds in [0, {MAX_SECONDS:g}], got {_show(v)}")
            fields[key] = float(v)
        units = d.get("edge_units", 1)
        if not _is_int(units) or not 1 <= units <= MAX_EDGE_UNITS:
            raise ValueError(f"{origin}: edge_units must be an integer in [1, {MAX_EDGE_UNITS}], got {_show(units)}")
        table = ()
        if d.get("verify_table") is not None:
            table = _table_from(d["verify_table"], origin)
        name = d.get("name")
        if not isinstance(name, str) or not name or name == "native":
            raise ValueError(f"{origin}: needs a name (not 'native')")
        texts = {}
        for key in ("source", "edge_source"):  # strings only: str() of a deep structure is its own hazard
            v = d.get(key, "")
            if not isinstance(v, str):
                raise ValueError(f"{origin}: {key} must be a string, got {type(v).__name__}")
            texts[key] = v
        label, block = _literature_from(d, fields, origin)
        if label == LITERATURE:
            # the engine runs only AR steps: every pass it runs is charged the published per-token time
            fields["verify_s"] = fields["ar_step_s"]
        return cls(name, edge_units=units, verify_table=table, label=label, literature=block, **texts, **fields)

    @classmethod
    def load(cls, path: str) -> "ComputeProfile":
        """The profile in file ``path`` (UTF-8 JSON, at most MAX_PROFILE_BYTES, an object at the
        top); ValueError naming the file for anything else: unreadable, too big, not UTF-8, not
        JSON, nested too deep for the parser, or refused by ``from_dict``."""
        origin = f"compute profile {path!r}"
        try:
            with open(path, "rb") as f:
                # The size is checked before reading (a regular file's), and the read is bounded
                # anyway (a device or pipe states no size).
                if os.fstat(f.fileno()).st_size > MAX_PROFILE_BYTES:
                    raise ValueError(f"{origin} is larger than {MAX_PROFILE_BYTES} bytes")
                raw = f.read(MAX_PROFILE_BYTES + 1)
        except OSError as exc:
            raise ValueError(f"cannot read compute profile {path!r}: {exc.strerror or exc}") from None
        if len(raw) > MAX_PROFILE_BYTES:
            raise ValueError(f"{origin} is larger than {MAX_PROFILE_BYTES} bytes")
        try:
            d = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ValueError(f"{origin} is not UTF-8 text: {exc.reason} at byte {exc.start}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{origin} is not valid JSON: {exc}") from None
        except RecursionError:
            # json's parser recurses per nesting level: a deeply nested file exhausts the stack.
            raise ValueError(f"{origin} is not valid JSON: nested too deep") from None
        except ValueError as exc:  # e.g. an integer past the interpreter's digit limit
            raise ValueError(f"{origin} is not valid JSON: {exc}") from None
        if not isinstance(d, dict):
            raise ValueError(f"{origin}: not a compute profile (the top level must be a JSON object, "
                             f"got {type(d).__name__})")
        return cls.from_dict(d, origin)


LITERATURE = "LITERATURE"
# What a LITERATURE profile's block must name, each a non-empty string ("batch" an integer, "tpot_ms"
# the published figure in ms); "version" says "not stated" where the source does not give one.
LITERATURE_TEXT_KEYS = ("engine", "version", "model", "gpu", "source", "prefill", "link")
LITERATURE_MAX_TEXT = 2000


def _literature_from(d: dict, fields: dict, origin: str) -> tuple:
    """A profile's label and LITERATURE block as (label, sorted (key, value) pairs); ValueError
    where a file claims a published figure without naming where it is from, or states an AR step
    other than the figure it cites."""
    label, block = d.get("label", ""), d.get("literature")
    if label in ("", None) and block is None:
        return "", ()
    if label != LITERATURE:
        raise ValueError(f"{origin}: label must be {LITERATURE!r} (the only label a profile file carries), "
                         f"got {_show(label)}")
    if not isinstance(block, dict):
        raise ValueError(f"{origin}: a {LITERATURE} profile needs a literature block naming "
                         f"{', '.join(LITERATURE_TEXT_KEYS)}, batch and tpot_ms")
    for key in LITERATURE_TEXT_KEYS:
        v = block.get(key)
        if not isinstance(v, str) or not v.strip() or len(v) > LITERATURE_MAX_TEXT:
            raise ValueError(f"{origin}: literature.{key} must be a non-empty string, got {_show(v)}")
    batch, tpot = block.get("batch"), block.get("tpot_ms")
    if not _is_int(batch) or not 1 <= batch <= MAX_TABLE_AXIS:
        raise ValueError(f"{origin}: literature.batch must be an integer in [1, {MAX_TABLE_AXIS}], got {_show(batch)}")
    if not _is_seconds(tpot) or not tpot:
        raise ValueError(f"{origin}: literature.tpot_ms must be a positive number, got {_show(tpot)}")
    if not math.isclose(fields["ar_step_s"], tpot / 1e3, rel_tol=1e-9):
        raise ValueError(f"{origin}: ar_step_s {fields['ar_step_s']:g} s is not the cited figure, "
                         f"literature.tpot_ms {tpot:g} ms")
    if d.get("verify_s") or d.get("verify_table") is not None:
        raise ValueError(f"{origin}: a {LITERATURE} profile states no verification pass (the engine verifies no "
                         "robot's drafts) and no batch table (it is one published per-token time)")
    if not str(d.get("source", "")).startswith(LITERATURE):
        raise ValueError(f"{origin}: a {LITERATURE} profile's source must begin with {LITERATURE!r}")
    extra = sorted(set(block) - {*LITERATURE_TEXT_KEYS, "batch", "tpot_ms", "note"})
    if extra:
        raise ValueError(f"{origin}: literature block has unknown keys {_show(extra)}")
    note = block.get("note", "")
    if not isinstance(note, str) or len(note) > LITERATURE_MAX_TEXT:
        raise ValueError(f"{origin}: literature.note must be a string")
    return LITERATURE, tuple(sorted(block.items()))


def _is_int(v) -> bool:
    """A JSON integer: an int that is not a bool (bool is a subclass of int in Python)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_seconds(v) -> bool:
    """A JSON number (not a bool, not a string) of seconds, finite and in [0, MAX_SECONDS]. Ints
    are compared as they are: a huge one must not overflow on its way to a float."""
    if _is_int(v):
        return 0 <= v <= MAX_SECONDS
    return isinstance(v, float) and math.isfinite(v) and 0.0 <= v <= MAX_SECONDS


def _show(v) -> str:
    """A refused value for a message, short whatever the file held."""
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _table_from(t, origin: str) -> tuple:
    """A profile's ``verify_table`` (``{"rows": [...], "blocks": [...], "s": seconds[rows][blocks]}``)
    as ``(rows, blocks, grid)``; ValueError otherwise, also when its pass time extrapolated over
    the whole capped range (``_table_worst_s``) exceeds MAX_SECONDS."""
    shape = f"{origin}: verify_table needs rows, blocks and s (seconds[rows][blocks])"
    if not isinstance(t, dict) or not all(isinstance(t.get(k), list) for k in ("rows", "blocks", "s")):
        raise ValueError(shape)
    rows, blocks, s = t["rows"], t["blocks"], t["s"]
    for axis, xs in (("rows", rows), ("blocks", blocks)):
        if not xs or not all(_is_int(x) and 1 <= x <= MAX_TABLE_AXIS for x in xs) or any(
                a >= b for a, b in zip(xs, xs[1:])):
            raise ValueError(f"{origin}: verify_table must have increasing rows and blocks, integers in "
                             f"[1, {MAX_TABLE_AXIS}]: {axis} is {_show(xs)}")
    if len(s) != len(rows) or not all(isinstance(r, list) and len(r) == len(blocks) for r in s):
        raise ValueError(f"{origin}: verify_table must have increasing rows and blocks and one time in "
                         f"[0, {MAX_SECONDS:g}] s per (row, block): s is not {len(rows)} x {len(blocks)}")
    bad = [x for r in s for x in r if not _is_seconds(x)]
    if bad:
        raise ValueError(f"{origin}: verify_table must have increasing rows and blocks and one time in "
                         f"[0, {MAX_SECONDS:g}] s per (row, block), got {_show(bad[0])}")
    table = (tuple(rows), tuple(blocks), tuple(tuple(float(x) for x in r) for r in s))
    worst, at_rows, at_blocks = _table_worst_s(*table)
    if worst > MAX_SECONDS:
        raise ValueError(f"{origin}: verify_table extrapolates to {worst:.4g} s a pass at {at_rows:g} rows x "
                         f"{at_blocks:g} blocks (extended at most {MAX_EXTRAPOLATION:g}x past its last rows and "
                         f"blocks); a pass may take at most {MAX_SECONDS:g} s")
    return table


def _table_worst_s(rows, blocks, grid) -> tuple:
    """The largest pass time ``_interp2`` gives over all rows and blocks, with where: (seconds,
    rows, blocks). It is at one of the table's rows or the rows cap, crossed with one of its
    blocks or the blocks cap: for a fixed block the time is piecewise linear in rows with breaks
    only there (held past the cap), and for each such row piecewise linear in blocks with breaks
    at the table's blocks and the cap, except where the last two rows' times cross past the last
    row, where it equals the last row's time (no more than at a break)."""
    rows_cap, blocks_cap = rows[-1] * MAX_EXTRAPOLATION, blocks[-1] * MAX_EXTRAPOLATION
    worst = (0.0, rows[0], blocks[0])
    for b in (*blocks, blocks_cap):
        col = [_lin(blocks, row, b) for row in grid]
        for r in (*rows, rows_cap):
            worst = max(worst, (_lin(rows, col, r), r, b))
    return worst


def _lin(xs, ys, x) -> float:
    """ys at x: linear between points, the first value below the first point, and past the last
    point the last value plus the last segment's slope if it grows (a measured time never falls
    with more rows or tokens; a noisy last segment must not make it)."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + max(0.0, slope) * (x - xs[-1])
    k = bisect.bisect_left(xs, x)
    w = (x - xs[k - 1]) / (xs[k] - xs[k - 1])
    return (1 - w) * ys[k - 1] + w * ys[k]


def _interp2(rows, blocks, table, r, b) -> float:
    """The table's time at ``r`` rows and ``b`` blocks: ``_lin`` along blocks then rows, each
    extended past the table at most to MAX_EXTRAPOLATION times its last point and held beyond
    (inside that, the same as uncapped)."""
    r = min(r, rows[-1] * MAX_EXTRAPOLATION)
    b = min(b, blocks[-1] * MAX_EXTRAPOLATION)
    return _lin(rows, [_lin(blocks, row, b) for row in table], r)


GO2_PAPER = ComputeProfile(
    "go2-paper", draft_token_s=0.072, verify_s=0.620, ar_step_s=0.354, exit_s=0.008, prefill_s=0.620,
    edge_prefill_s=0.300, source="FSD paper Table 8 (Go2 Jetson Orin + A100); prefills are this project's estimates",
    edge_source="go2-paper: 72 ms per draft token on the Go2's Jetson Orin (FSD paper Table 8); the draft's "
                "prefill of a frame and prompt 300 ms (this project's estimate; the paper gives none)")

COMPUTE_PROFILES = {
    "native": ComputeProfile("native"),
    "go2-paper": GO2_PAPER,
    # What-if, labelled as such: as go2-paper but a robot with one accelerator per pre-draft worker
    # (go2-paper itself serialises all drafting on one EdgeDevice, as on a Jetson).
    "go2-paper-multigpu": ComputeProfile("go2-paper-multigpu", draft_token_s=0.072, verify_s=0.620, ar_step_s=0.354,
                                         exit_s=0.008, edge_units=64, prefill_s=0.620, edge_prefill_s=0.300,
                                         source=GO2_PAPER.source, edge_source=GO2_PAPER.edge_source),
}


# FSD paper Table 9 (A100, Vicuna-7B): one pass at batch 1 / 8 / 16 / 32 / 64, a shared cloud
# GPU under load from other tenants' rows. The paper gives no block length: the one column is used
# for every block (blocks 5).
A100_TABLE9 = ComputeProfile(
    "a100-fsd-table9", verify_s=0.0179, ar_step_s=0.0179, exit_s=0.001, prefill_s=0.0307,
    draft_token_s=GO2_PAPER.draft_token_s, edge_prefill_s=GO2_PAPER.edge_prefill_s,
    verify_table=((1, 8, 16, 32, 64), (5,), ((0.0179,), (0.0307,), (0.0458,), (0.0969,), (0.2588,))),
    source="FSD paper Table 9 (A100, Vicuna-7B, ms per pass at batch 1/8/16/32/64: 17.9/30.7/45.8/96.9/258.8); "
           "AR step = the batch-1 pass; prefill = the batch-8 pass and exits 1 ms: this project's estimates",
    edge_source=GO2_PAPER.edge_source)
COMPUTE_PROFILES["a100-fsd-table9"] = A100_TABLE9


@dataclass(frozen=True)
class RobotProfile:
    """The robot's drafting alone (``--robot``): a what-if for another draft speed, combined with
    any cloud profile (``ComputeProfile.with_robot``). Each names its source; a figure measured on
    another model or board is a what-if for ours, and says so."""

    name: str
    draft_token_s: float
    edge_prefill_s: float
    source: str


# The draft prefill of the faster robots is go2-paper's 300 ms scaled by their token time (this
# project's estimate: none of the sources measures a prefill).
ROBOT_PROFILES = {
    "orin-paper": RobotProfile("orin-paper", GO2_PAPER.draft_token_s, GO2_PAPER.edge_prefill_s, GO2_PAPER.edge_source),
    "orin-nano-mlc-int4": RobotProfile(
        "orin-nano-mlc-int4", 1 / 35, GO2_PAPER.edge_prefill_s * (1 / 35) / GO2_PAPER.draft_token_s,
        "WHAT-IF: NVIDIA's MLC INT4 figure for Gemma-2-2B on a Jetson Orin Nano Super, ~35 tokens/s (another "
        "model); prefill scaled from go2-paper's by the token time (this project's estimate)"),
    "orin-nano-trt-int4": RobotProfile(
        "orin-nano-trt-int4", 0.0167, GO2_PAPER.edge_prefill_s * 0.0167 / GO2_PAPER.draft_token_s,
        "WHAT-IF: a Qwen3-VL-based 2B VLM at INT4 under TensorRT Edge-LLM on a Jetson Orin Nano 8 GB, 16.7 ms a "
        "token (repository hokwangchoi/jetson-orin-nano-benchmarks; another model and board); prefill scaled "
        "from go2-paper's by the token time (this project's estimate)"),
}


def get_robot(name: str) -> RobotProfile:
    """A named robot profile; ValueError naming the known ones otherwise."""
    if name not in ROBOT_PROFILES:
        raise ValueError(f"unknown robot profile {name!r}; known: {', '.join(ROBOT_PROFILES)}")
    return ROBOT_PROFILES[name]


def robot_arg(text: str) -> str:
    """argparse type for --robot."""
    import argparse
    try:
        get_robot(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


LOAD_SUFFIX = ":load="  # ``PROFILE:load=N``: that cloud with N other sessions' rows in every pass


def get_compute(name: str) -> ComputeProfile:
    """A named profile, or a profile file (``edgespec-profile`` writes one), optionally loaded
    (``NAME:load=N``, ``ComputeProfile.with_load``): ValueError otherwise."""
    base, sep, load = name.rpartition(LOAD_SUFFIX)
    if sep:
        try:
            rows = int(load)
        except ValueError:
            raise ValueError(f"compute profile {name!r}: the load must be a whole number of rows, got {load!r}") from None
        return get_compute(base).with_load(rows)
    if name in COMPUTE_PROFILES:
        return COMPUTE_PROFILES[name]
    if name.endswith(".json") or os.path.sep in name or os.path.isfile(name):
        return ComputeProfile.load(name)
    raise ValueError(f"unknown compute profile {name!r}; known: {', '.join(COMPUTE_PROFILES)}, or a profile file "
                     "(edgespec-profile writes one)")


def compute_help() -> str:
    """What --compute accepts, for every command line that takes it."""
    return (f"native (no emulation), a named profile ({', '.join(n for n in COMPUTE_PROFILES if n != 'native')}) or a "
            f"profile file measured by edgespec-profile, whose times are then emulated; NAME{LOAD_SUFFIX}N: that measured "
            "cloud shared with N other sessions' rows in every pass")


def compute_arg(text: str) -> str:
    """argparse type for --compute: a known name or a readable profile file (checked now, so a
    typo fails before any model loads)."""
    import argparse
    try:
        get_compute(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# What one draft forward over w tree nodes (a level of a token tree) costs the robot, in draft-token
# times: a memory-bound device reads the weights once for the whole level. (width, factor) points,
# linear between them and on the last segment's slope past the last. Source: the FSD paper's Table 9, a Jetson Orin drafting
# Qwen2-VL-2B at batch 16 costs 1.37x batch 1 (the points between are this project's interpolation).
DRAFT_LEVEL_COST = ((1, 1.0), (16, 1.37))


def level_cost(width: int, table=DRAFT_LEVEL_COST) -> float:
    """A draft level of ``width`` nodes, in draft-token times (``DRAFT_LEVEL_COST``)."""
    if width < 1:
        raise ValueError(f"a draft level has at least one node, got {width}")
    return _lin([w for w, _ in table], [f for _, f in table], width)


def pad_to(started: float, target_s: float) -> float:
    """Sleep until target_s has passed since `started` (perf_counter); returns the elapsed time."""
    remaining = target_s - (time.perf_counter() - started)
    if remaining > 0:
        time.sleep(remaining)
    return time.perf_counter() - started


class EdgeDevice:
    """The robot's accelerator under emulation: ``units`` (1 on a Jetson) serial slots that every
    drafting thread shares. Each drafted token holds a slot for ``draft_token_s`` (real compute
    included); the decision's own drafting (``main``) goes before queued pre-draft tokens, except
    ``urgent`` ones (pipe+fsd: the pre-draft of a guessed rejection, which voids the main path's
    drafting ahead). With no emulated cost (``native``) the slots still serialize the real drafting:
    on a CPU the threads would only contend for the same cores (and, in Python, the one interpreter
    lock that the ROS executor needs too)."""

    def __init__(self, draft_token_s: float = 0.0, units: int = 1, prefill_s: float = 0.0):
        if units < 1:
            raise ValueError(f"edge units must be >= 1, got {units}")
        self.draft_token_s, self.units, self.prefill_s = draft_token_s, units, prefill_s
        self.busy_s = 0.0  # slot-seconds used (all threads)
        self.tokens = 0
        self._cond = threading.Condition()
        self._busy = 0
        self._main_waiting = 0
        self._urgent_waiting = 0

    @classmethod
    def for_profile(cls, profile: "ComputeProfile | None") -> "EdgeDevice":
        if profile is None:
            return cls()
        return cls(profile.draft_token_s, profile.edge_units, profile.edge_prefill_s)

    def token(self, main: bool = True, urgent: bool = False):
        """Hold a slot for one drafted token (the body is that token's real compute). Order:
        urgent, then main, then the rest."""
        return self.hold(self.draft_token_s, main, urgent, tokens=1)

    def prefill(self):
        """Hold a main slot for the draft's prefill of a decision's prompt (``prefill_s``; the
        body is the real prefill)."""
        return self.hold(self.prefill_s, True)

    @contextlib.contextmanager
    def hold(self, seconds: float, main: bool = True, urgent: bool = False, tokens: int = 0):
        """Hold a slot while the body runs, and until ``seconds`` have passed since it began."""
        urgent = urgent and not main
        with self._cond:
            self._main_waiting += main
            self._urgent_waiting += urgent
            try:
                self._cond.wait_for(lambda: self._busy < self.units and (
                    urgent or (main and not self._urgent_waiting)
                    or not (self._main_waiting or self._urgent_waiting)))
            finally:
                self._main_waiting -= main
                self._urgent_waiting -= urgent
            self._busy += 1
        t0 = time.perf_counter()
        try:
            yield
        finally:
            elapsed = pad_to(t0, seconds)
            with self._cond:
                self._busy -= 1
                self.tokens += tokens
                self.busy_s += elapsed
                self._cond.notify_all()

    def main_token(self):
        return self.token(True)

    def level(self, width: int):
        """Hold a main slot for one draft forward over a tree level of ``width`` nodes: one token's
        time scaled by ``level_cost`` (never ``width`` tokens, nor two levels at once)."""
        return self.hold(self.draft_token_s * level_cost(width), True, tokens=width)

    def background_token(self):
        return self.token(False)
