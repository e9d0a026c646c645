"""edgespec-profile: the real-shape configs, the measurement code on tiny shapes on CPU,
and the compute profile file it writes, read back by every benchmark."""
import json
import os

import pytest
import torch

from edgespec_ros.bench import gpu_measure as gm
from edgespec_ros.bench import gpu_profile as gp
from edgespec_ros.decoding.compute import GO2_PAPER, PROFILE_FORMAT, ComputeProfile, compute_arg, get_compute


def test_real_shapes_have_the_published_parameter_counts():
    # Qwen2-VL-2B-Instruct: 2.21 B parameters; Qwen2-VL-7B-Instruct: 8.29 B (model cards)
    assert round(gm.param_count(gm.load_shape("qwen2-vl-2b")) / 1e9, 2) == 2.21
    assert round(gm.param_count(gm.load_shape("qwen2-vl-7b")) / 1e9, 2) == 8.29
    cfg = gm.build_config(gm.load_shape("qwen2-vl-7b"))
    assert gm.special(cfg, "image_token_id") == 151655 and gm.special(cfg, "eos_token_id") == 151645


def test_synthetic_prompt_is_a_448_frame_with_256_image_tokens():
    cfg = gm.build_config(gm.load_shape("qwen2-vl-7b"))
    p = gm.synthetic_prompt(cfg, seed=1)
    assert int(p.mm_token_type_ids.sum()) == 256  # 448 / 14 = 32 patches a side, merged 2 x 2
    assert tuple(p.image_grid_thw[0].tolist()) == (1, 32, 32)
    assert p.pixel_values.shape == (1024, 3 * 2 * 14 * 14)
    assert int(p.input_ids.max()) < 151936
    assert p.num_tokens == 256 + 2 + 48 + 96 + 4


def test_unknown_shape_is_a_clear_error():
    with pytest.raises(SystemExit, match="no model shape 'qwen9'"):
        gm.load_shape("qwen9")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gp"))
    assert gp.main(["--shapes", "tiny,tiny", "--device", "cpu", "--quick", "--dtypes", "float32,bfloat16",
                    "--out", out]) == 0
    with open(os.path.join(out, "measurements.json")) as f:
        result = json.load(f)
    with open(os.path.join(out, "profile.json")) as f:
        profile = json.load(f)
    return out, result, profile


def test_tiny_run_measures_every_part(tiny_run):
    _, result, _ = tiny_run
    target, draft = result["models"]["tiny"], result["models"]["tiny (draft)"]
    assert {(g["rows"], g["block"]) for g in target["grid"]} == {(r, b) for r in (1, 2) for b in (1, 2, 3)}
    assert all(g["s"] > 0 and 0 < g["forward_s"] <= g["s"] for g in target["grid"])
    assert target["prefill"]["image_tokens"] == 4 and target["prefill"]["s"] > 0
    assert target["exits"]["layers"] == [1, 2] and len(target["exits"]["rows"]) == 1
    assert draft["draft_token"]["s"] > 0
    assert set(target["invariance"]) == {"float32", "bfloat16"}
    assert "bfloat16" in target["precision_cost"]
    # fp32 on CPU: the batched pass agrees with the lone one to float rounding, so greedy SD
    # (alone or batched) gives the target's own tokens (the lossless claim's precision condition)
    fp32 = target["invariance"]["float32"]
    assert [r["batch"] for r in fp32["runs"]] == [1, 2, 4]
    assert all(r["divergent"] == 0 for r in fp32["runs"])
    assert fp32["logits"]["max_abs_delta"] < 1e-4 and fp32["logits"]["argmax_flips"] == 0


def test_profile_file_is_read_by_the_benchmarks(tiny_run):
    out, result, d = tiny_run
    assert d["format"] == PROFILE_FORMAT and d["name"] == "cpu-tiny-float32"
    path = os.path.join(out, "profile.json")
    p = get_compute(path)
    assert compute_arg(path) == path
    assert p.emulated and p.verify_table
    grid = {(g["rows"], g["block"]): g["s"] for g in result["models"]["tiny"]["grid"]}
    assert p.pass_s(2, 3) == pytest.approx(grid[(2, 3)])
    assert p.pass_s(1, 1) == pytest.approx(grid[(1, 1)])
    assert p.prefill_s == pytest.approx(result["models"]["tiny"]["prefill"]["s"])
    # the robot's terms stay the go2-paper Orin figures, labelled
    assert p.draft_token_s == GO2_PAPER.draft_token_s and "Orin" in p.edge_source
    assert d["server_proxy"]["draft_token_s"] > 0 and "not a robot figure" in d["server_proxy"]["note"]


def test_report_names_the_device_and_the_proxy(tiny_run):
    _, result, _ = tiny_run
    text = gp.format_report(result)
    assert "cpu" in text and "random weights" in text and "server-side proxy" in text
    assert "batch invariance, float32" in text and "divergent 0/4" in text


def test_pass_time_interpolates_and_never_falls_past_the_table():
    p = ComputeProfile("t", verify_s=0.02, verify_table=((1, 4), (1, 5), ((0.010, 0.014), (0.016, 0.013))))
    assert p.pass_s(1, 1) == pytest.approx(0.010)
    assert p.pass_s(1, 3) == pytest.approx(0.012)
    assert p.pass_s(2, 1) == pytest.approx(0.012)
    assert p.pass_s(4, 9) == pytest.approx(0.013)  # a noisy falling segment: held, not extrapolated down
    assert p.pass_s(8, 1) == pytest.approx(0.016 + 0.002 * 4)  # a growing one: extended
    assert p.exit_available_s(14, 28, pass_s=0.1) == pytest.approx(0.05)
    flat = get_compute("go2-paper")
    assert flat.pass_s(8, 16) == flat.verify_s and flat.pass_s(8, 1, ar=True) == flat.ar_step_s
    assert get_compute("native").pass_s(8, 16) == 0.0


@pytest.mark.parametrize("bad, match", [
    ({"format": "x"}, "not a compute profile"),
    ({"format": PROFILE_FORMAT, "name": "a", "verify_s": -1}, "verify_s must be seconds"),
    ({"format": PROFILE_FORMAT, "name": "a", "verify_table": {"rows": [2, 1], "blocks": [1], "s": [[1], [1]]}},
     "increasing rows"),
    ({"format": PROFILE_FORMAT, "name": "a", "verify_table": {"rows": [1], "blocks": [1, 2], "s": [[1]]}},
     "one time"),
    ({"format": PROFILE_FORMAT, "name": "native"}, "needs a name"),
])
def test_bad_profile_files_are_refused_with_a_reason(tmp_path, bad, match):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=match):
        get_compute(str(path))


def test_missing_or_broken_profile_file_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read compute profile"):
        get_compute(str(tmp_path / "nope.json"))
    (tmp_path / "b.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        get_compute(str(tmp_path / "b.json"))
    with pytest.raises(ValueError, match="unknown compute profile 'go3'"):
        get_compute("go3")


def test_batched_sd_diverges_when_the_batched_pass_differs():
    """The invariance check can fail: a pass that perturbs batched logits (as bf16 kernels may)
    makes batched greedy SD leave the target's lone tokens, and it is counted."""
    shape = gm.load_shape("tiny")
    lm = gm.build_lm(shape, torch.device("cpu"), torch.float32, seed=0)
    cfg = lm.model.config
    prompts = [gm.synthetic_prompt(cfg, seed=i, image=56, text=8, history=8 + i) for i in range(4)]
    refs = [gm.lone_reference(lm, p, 12)[0] for p in prompts]
    clean = gm.sd_batched(lm, prompts, refs, [12] * 4, batch=4, gamma=3, seed=0)
    assert gm.compare(refs, clean["tokens"])["divergent"] == 0
    head = lm.model.get_output_embeddings()

    def perturb_batched(_m, _inp, out):  # only batched passes (more than one row) are perturbed
        return out + torch.randn_like(out) * 5.0 if out.shape[0] > 1 else out
    handle = head.register_forward_hook(perturb_batched)
    try:
        noisy = gm.sd_batched(lm, prompts, refs, [12] * 4, batch=4, gamma=3, seed=0)
    finally:
        handle.remove()
    report = gm.compare(refs, noisy["tokens"])
    assert report["divergent"] > 0 and all(0 <= k < 12 for k in report["first_divergent_positions"])


def test_the_robots_draft_prefill_holds_its_one_accelerator():
    """Prefill is emulated on the robot too: edge_prefill_s on the one accelerator, so a pre-draft
    token waits for it."""
    import threading
    import time
    from edgespec_ros.decoding.compute import EdgeDevice
    dev = EdgeDevice.for_profile(ComputeProfile("t", draft_token_s=0.01, edge_prefill_s=0.2))
    inside = threading.Event()

    def prefill():
        with dev.prefill():
            inside.set()
    t = threading.Thread(target=prefill)
    t0 = time.perf_counter()
    t.start()
    inside.wait(5)
    with dev.background_token():
        waited = time.perf_counter() - t0
    t.join(5)
    assert waited >= 0.2 and dev.tokens == 1 and dev.busy_s >= 0.2 + 0.01
    assert get_compute("go2-paper").edge_prefill_s == 0.3 and get_compute("go2-paper").prefill_s == 0.62


@pytest.mark.parametrize("mode", ["sd", "pipe"])
def test_every_edge_drafted_decision_charges_the_robots_draft_prefill(mode):
    """A decision's draft prefill runs on the robot's emulated accelerator: with edge_prefill_s
    0.3 s (and nothing else emulated) the decision's drafting time and the device's busy time
    include it, once per decision."""
    import time
    from edgespec_ros.cloud.local import LocalVerifier
    from edgespec_ros.robot.decoder import EdgeDecoder
    from edgespec_ros.robot.settings import DecodeConfig
    from wire_helpers import make_pair
    pair = make_pair()
    dec = EdgeDecoder(pair.draft, LocalVerifier(pair.target), draft_compute=ComputeProfile("t", edge_prefill_s=0.3))
    t0 = time.perf_counter()
    for _ in range(2):
        got = dec.decide("find the silver bottle", pair.image, DecodeConfig(mode=mode, gamma=3, max_new_tokens=6))
        assert got.metrics.t_draft >= 0.3
    assert time.perf_counter() - t0 >= 0.6 and dec.device.busy_s >= 0.6
    dec.close()


def test_exits_are_timed_within_the_rounds_own_pass():
    """A measured profile's pass depends on the block: the verifier's exit sender makes exit l of
    L available at l/L of the round's own pass (plus the exits' cost), not of a fixed one."""
    import asyncio
    from edgespec_ros.decoding.exits import ExitResult
    from edgespec_ros.cloud.exit_stream import ExitSender
    p = ComputeProfile("t", exit_s=0.001, verify_table=((1,), (1, 16), ((0.010, 0.040),)))

    async def available_at(block):
        sender = ExitSender(None, 1, 1, 0.0, p, 28, block=block)
        sender.push(ExitResult(14, 0, 5, confidence=0.5))
        at = sender.items[0][0]
        sender.cancel()
        return at
    assert asyncio.run(available_at(16)) == pytest.approx(0.040 * 14 / 28 + 0.001)
    assert asyncio.run(available_at(1)) == pytest.approx(0.010 * 14 / 28 + 0.001)


# Crafted profile files (--compute FILE is input): wrong types, a table that extrapolates to minutes,
# parser-crashing nesting and oversize files are refused with a reason naming the file.
_STEEP_2X2 = {"rows": [1, 2], "blocks": [1, 2], "s": [[0.01, 20.0], [20.0, 40.0]]}


@pytest.mark.parametrize("extra, match", [
    ({"verify_s": True}, "verify_s must be seconds"),  # bool is an int in Python: not 1 s
    ({"draft_token_s": "0.5"}, "draft_token_s must be seconds"),  # a string number is not a number
    ({"exit_s": float("nan")}, "exit_s must be seconds"),
    ({"prefill_s": 10 ** 400}, "prefill_s must be seconds"),  # no overflow on the way to a float
    ({"edge_units": True}, "edge_units must be an integer"),
    ({"edge_units": 2.0}, "edge_units must be an integer"),
    ({"edge_units": 65}, "edge_units must be an integer in \\[1, 64\\]"),
    ({"verify_table": {"rows": [1, 2.5], "blocks": [1], "s": [[0.1], [0.2]]}}, "integers in"),  # was read as 2
    ({"verify_table": {"rows": [True, 2], "blocks": [1], "s": [[0.1], [0.2]]}}, "integers in"),
    ({"verify_table": {"rows": [1], "blocks": [0], "s": [[0.1]]}}, "integers in"),
    ({"verify_table": {"rows": [1], "blocks": [1, 2], "s": [[0.1, True]]}}, "one time"),
    ({"verify_table": {"rows": [1], "blocks": [1, 2], "s": [[0.1, "0.2"]]}}, "one time"),
    ({"verify_table": {"rows": [1], "blocks": [1, 2], "s": [[0.1, None]]}}, "one time"),
    ({"verify_table": {"rows": [1], "blocks": [1], "s": {"1": [0.1]}}}, "needs rows, blocks and s"),
    ({"verify_table": [[0.1]]}, "needs rows, blocks and s"),
    ({"verify_table": _STEEP_2X2}, "extrapolates to .* s a pass at 4 rows x 4 blocks"),
    ({"source": {"nested": [1]}}, "source must be a string"),
])
def test_crafted_profile_files_are_refused_with_a_reason(tmp_path, extra, match):
    path = tmp_path / "crafted.json"
    path.write_text(json.dumps({"format": PROFILE_FORMAT, "name": "crafted", **extra}))
    with pytest.raises(ValueError, match=match) as info:
        get_compute(str(path))
    assert "crafted.json" in str(info.value)
    # and the CLI's --compute check says the same
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match=match):
        compute_arg(str(path))


def test_a_steep_table_would_have_charged_minutes_and_is_refused():
    """The finding: a valid-looking 2 x 2 table extended along its last slopes to 64 rows x 65
    blocks (what the verifier can ask) charged minutes a pass; the extension now stops at
    MAX_EXTRAPOLATION x the table's last rows and blocks, and the loader checks the worst case."""
    from edgespec_ros.decoding import compute as c
    rows, blocks, s = (1, 2), (1, 2), tuple(tuple(r) for r in _STEEP_2X2["s"])
    uncapped = c._lin(rows, [c._lin(blocks, r, 65) for r in s], 64)
    assert uncapped > 120  # what the old extrapolation charged
    assert c._interp2(rows, blocks, s, 64, 65) == pytest.approx(c._interp2(rows, blocks, s, 4, 4))
    assert c._table_worst_s(rows, blocks, s) == (pytest.approx(120.04), 4.0, 4.0)  # over 60 s: refused (above)
    # a milder 2 x 2 table loads, and its pass time is held at the cap
    mild = ComputeProfile.from_dict({"format": PROFILE_FORMAT, "name": "mild", "verify_table": {
        "rows": [1, 2], "blocks": [1, 2], "s": [[0.01, 1.0], [1.0, 2.0]]}})
    assert mild.pass_s(64, 65) == pytest.approx(mild.pass_s(4, 4)) == pytest.approx(6.04)
    assert mild.pass_s(3, 3) == pytest.approx(3.0 + (3.0 - 1.99))  # within the cap: as before
    assert max(mild.pass_s(r, b) for r in range(1, 130) for b in range(1, 70)) <= c.MAX_SECONDS


def test_deeply_nested_huge_or_non_object_profile_files_are_clear_errors(tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="deep.json.*nested too deep"):
        get_compute(str(deep))
    deep_obj = tmp_path / "deep2.json"
    deep_obj.write_text('{"format": ' + '{"a": ' * 100_000 + "1" + "}" * 100_000 + "}")
    with pytest.raises(ValueError, match="deep2.json.*nested too deep"):
        get_compute(str(deep_obj))
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"format": PROFILE_FORMAT, "name": "h", "source": "x" * (1 << 20)}))
    with pytest.raises(ValueError, match="huge.json.* is larger than 1048576 bytes"):
        get_compute(str(huge))
    top = tmp_path / "list.json"
    top.write_text("[1, 2]")
    with pytest.raises(ValueError, match="list.json.*top level must be a JSON object"):
        get_compute(str(top))
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"format": "\xff"}')
    with pytest.raises(ValueError, match="latin.json.* is not UTF-8"):
        get_compute(str(latin))
    digits = tmp_path / "digits.json"
    digits.write_text('{"verify_s": ' + "9" * 5000 + "}")  # past int's digit limit: ValueError in json
    with pytest.raises(ValueError, match="digits.json.* not valid JSON"):
        get_compute(str(digits))


def test_committed_profiles_load_and_keep_their_pass_times():
    """docs/profiles' compute profiles still load, and their table gives the same pass times as
    before the extrapolation cap, inside the table and up to MAX_EXTRAPOLATION x its last rows and
    blocks (figures computed with the uncapped code); beyond, the time is held at the cap."""
    import glob
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "profiles")
    loaded = []
    for path in sorted(glob.glob(os.path.join(root, "*.json"))):
        with open(path) as f:
            if json.load(f).get("format") == PROFILE_FORMAT:
                loaded.append(get_compute(path))
    # measured profiles carry their table; a production engine's published figure (LITERATURE) has none
    assert loaded and all(bool(p.verify_table) != p.cloud_only for p in loaded)
    p = get_compute(os.path.join(root, "h200-qwen2-vl-7b-bf16.json"))
    before = {(1, 5): 0.024319348500000615, (1, 1): 0.02221159600000533, (3, 7): 0.03370965400000614,
              (8, 5): 0.050068025999998156, (10, 10): 0.09402511750000109, (16, 16): 0.1721374189999949,
              (5, 13): 0.05580863937500036, (16, 1): 0.06996774649999793, (24, 5): 0.14419888450001395,
              (16, 24): 0.220536084999992, (32, 32): 0.5564530729999717}
    for (rows, block), s in before.items():
        assert p.pass_s(rows, block) == pytest.approx(s, rel=1e-12), (rows, block)
    assert p.pass_s(64, 65) == pytest.approx(before[(32, 32)])  # was 2.20 s, extrapolated 4x past the table


def test_bench_compute_label_names_the_profiles_own_source():
    """edgespec-bench's ``compute:`` line says EMULATED and where the padded timings come from: a
    measured profile file names its device and commit, go2-paper the paper; native is not emulated."""
    from edgespec_ros.bench.cli import compute_label
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "profiles")
    measured = get_compute(os.path.join(root, "h200-qwen2-vl-7b-bf16.json"))
    assert compute_label(measured) == f"{measured.name} (EMULATED: padded to the profile's timings: {measured.source})"
    assert "NVIDIA H200" in compute_label(measured) and "paper Go2 latencies" not in compute_label(measured)
    assert compute_label(GO2_PAPER) == ("go2-paper (EMULATED: padded to the profile's timings: "
                                        "FSD paper Table 8 (Go2 Jetson Orin + A100); prefills are this project's estimates)")
    assert compute_label(get_compute("native")) == "native"
    assert compute_label(ComputeProfile("bare", verify_s=0.1)).endswith("(EMULATED: padded to the profile's timings: no source given)")


def test_combine_takes_each_point_from_the_quietest_pass_of_all_runs(tiny_run, tmp_path):
    out, result, _ = tiny_run
    grid = result["models"]["tiny"]["grid"]
    assert all(len(g["pass_s"]) == 1 and g["pass_s"][0] == pytest.approx(gp.point_s(g)) for g in grid)
    slow = json.loads(json.dumps(result))  # a second run inside a slow phase: every sample 3x, one point 0.5x
    for g in slow["models"]["tiny"]["grid"]:
        g["all_s"] = [3 * x for x in g["all_s"]]
        del g["pass_s"]  # an older file: its passes come from all_s and the plan's reps
    quick = slow["models"]["tiny"]["grid"][-1]
    quick["all_s"] = [x / 6 for x in quick["all_s"]]
    paths = []
    for name, r in (("a", result), ("b", slow)):
        paths.append(str(tmp_path / f"{name}.json"))
        with open(paths[-1], "w") as f:
            json.dump(r, f)
    assert gp.main(["--combine", *paths, "--out", str(tmp_path / "c")]) == 0
    profile = get_compute(str(tmp_path / "c" / "profile.json"))
    with open(tmp_path / "c" / "measurements.json") as f:
        merged = json.load(f)
    by = {(g["rows"], g["block"]): g for g in grid}
    for g in merged["models"]["tiny"]["grid"][:-1]:
        assert len(g["pass_s"]) == 2 and len(g["all_s"]) == 2 * len(by[(g["rows"], g["block"])]["all_s"])
        assert profile.pass_s(g["rows"], g["block"]) == pytest.approx(by[(g["rows"], g["block"])]["pass_s"][0])
    last = merged["models"]["tiny"]["grid"][-1]
    assert profile.pass_s(last["rows"], last["block"]) == pytest.approx(gp.statistics.median(quick["all_s"]))
    assert [c["name"] for c in merged["combined_from"]] == [f"{tmp_path.name}/a.json", f"{tmp_path.name}/b.json"]


def test_combine_refuses_runs_of_another_precision(tiny_run, tmp_path):
    _, result, _ = tiny_run
    other = json.loads(json.dumps(result))
    other["models"]["tiny"]["dtype"] = "bfloat16"
    with pytest.raises(ValueError, match="one device, target and precision"):
        gp.combine([result, other])
