"""The drafter as deployed on a Jetson: device, dtype and quantization options with clear errors,
and Qwen2-VL's min/max pixel bounds (a 1280x720 camera frame is not ~1,200 image tokens), with
edge and cloud still agreeing on the image tokens when the robot reads fewer pixels than the
verifier would."""
import copy

import numpy as np
import pytest
import torch

from edgespec_ros.cloud.target import target_generate
from edgespec_ros.robot.decoder import EdgeDecoder
from edgespec_ros.robot.settings import DecodeConfig
from edgespec_ros.decoding.engines import ModelLoadError, load_model, resolve_device, resolve_dtype
from edgespec_ros.decoding.inputs import image_tokens, limit_pixels, pixel_bounds
from edgespec_ros.decoding.sampling import SamplingParams
from edgespec_ros.cloud.local import LocalVerifier
from edgespec_ros.models import default_model_path
from edgespec_ros.nodes import params

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def embedded_pair():
    return load_model(default_model_path("draft")), load_model(default_model_path("target"))


def _frame(h=720, w=1280, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_names_resolve_and_bad_options_name_the_fix():
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float16") is torch.float16
    assert resolve_dtype("auto", torch.device("cpu")) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ModelLoadError, match="dtype 'int3'"):
        resolve_dtype("int3")
    with pytest.raises(ModelLoadError, match="not a torch device"):
        resolve_device("gpu0")
    with pytest.raises(ModelLoadError, match="only cpu, cuda and mps"):
        resolve_device("xpu")
    path = default_model_path("draft")
    with pytest.raises(ModelLoadError, match="quantization 'int4' is not one of"):
        load_model(path, quantization="int4")
    with pytest.raises(ModelLoadError, match="needs a CUDA device"):
        load_model(path, device="cpu", quantization="nf4")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_a_missing_gpu_fails_loudly_and_auto_falls_back_to_the_cpu():
    with pytest.raises(ModelLoadError, match="CUDA is not available.*set device to cpu"):
        load_model(default_model_path("draft"), device="cuda")
    assert resolve_device("auto").type == "cpu"
    assert load_model(default_model_path("draft"), device="auto").device.type == "cpu"


def test_the_drafter_node_declares_the_deployment_options_with_jetson_defaults():
    spec = {p.name: p for p in params.DRAFTER}
    assert spec["device"].default == "auto" and spec["dtype"].default == "auto"
    assert spec["quantization"].choices == ("none", "int8", "nf4")
    assert spec["max_pixels"].default == 448 * 448
    with pytest.raises(ValueError, match="not one of"):
        spec["dtype"].validate("fp8")


def test_a_bfloat16_drafter_is_verified_to_the_targets_own_greedy_output(embedded_pair):
    """Half-precision drafts may differ from fp32 drafts; the verified text may not differ from
    what the (fp32) target says alone: the lossless guarantee does not depend on the drafter."""
    _, target = embedded_pair
    draft = load_model(default_model_path("draft"), dtype="bf16")
    assert draft.model.dtype is torch.bfloat16
    image = _frame(112, 112)
    decoder = EdgeDecoder(draft, LocalVerifier(target))
    cfg = DecodeConfig(mode="sd", gamma=4, max_new_tokens=32, params=GREEDY, seed=0)
    decision = decoder.decide("find the silver bottle", image, cfg)
    reference = target_generate(target, decoder.make_prompt("find the silver bottle", image)[1],
                                DecodeConfig(mode="ar", max_new_tokens=32, params=GREEDY))
    assert decision.tokens == reference
    assert decision.metrics.accepted > 0  # the bf16 drafter still drafts the target's tokens


def test_max_pixels_bounds_a_720p_frame_to_a_jetson_sized_prompt():
    from edgespec_ros.decoding.engines import load_image_processor
    proc = load_image_processor(default_model_path("draft"))
    qwen = copy.deepcopy(proc)  # Qwen2-VL-2B's own bounds: 4 .. 16384 merged tokens
    qwen.size.shortest_edge, qwen.size.longest_edge = 4 * 28 * 28, 16384 * 28 * 28
    assert image_tokens(720, 1280, qwen) == 26 * 46  # 1,196 tokens at the model's own bounds
    assert limit_pixels(qwen, max_pixels=448 * 448) == (4 * 28 * 28, 448 * 448)
    assert image_tokens(720, 1280, qwen) == 12 * 21  # 588x336: 252 tokens
    # A cap never raises the model's own limit (the embedded model reads 112x112 at most).
    own = pixel_bounds(proc)
    assert limit_pixels(proc, max_pixels=448 * 448) == own
    with pytest.raises(ValueError, match="below one merged image token"):
        limit_pixels(copy.deepcopy(proc), max_pixels=100)
    with pytest.raises(ValueError, match="min_pixels .* > max_pixels"):
        limit_pixels(copy.deepcopy(proc), min_pixels=own[1] + 1)


def test_a_drafter_reading_fewer_pixels_than_the_verifier_still_agrees_on_the_image_tokens(embedded_pair):
    """The robot resizes the frame before the uplink JPEG, so the verifier (with its own, larger
    bound) reads the same image at the same size: same prompt tokens, same lossless output, and
    fewer uplink bytes than the camera's resolution would cost."""
    _, target = embedded_pair
    draft = load_model(default_model_path("draft"), max_pixels=56 * 112)
    assert pixel_bounds(draft.image_processor)[1] == 56 * 112 < pixel_bounds(target.image_processor)[1]
    frame = _frame()
    decoder = EdgeDecoder(draft, LocalVerifier(target))
    prompt, inputs = decoder.make_prompt("find the silver bottle", frame)
    assert int(inputs.mm_token_type_ids.sum()) == image_tokens(720, 1280, draft.image_processor) == 2 * 3
    cfg = DecodeConfig(mode="sd", gamma=4, max_new_tokens=16, params=GREEDY, seed=0)
    decision = decoder.decide("find the silver bottle", frame, cfg)  # the verifier rebuilt the same prompt
    reference = target_generate(target, inputs, DecodeConfig(mode="ar", max_new_tokens=16, params=GREEDY))
    assert decision.tokens == reference
    full = EdgeDecoder(load_model(default_model_path("draft")), LocalVerifier(target))
    assert len(prompt.jpeg) < len(full.make_prompt("find the silver bottle", frame)[0].jpeg)


def _ecosystem_or_skip(path):
    from edgespec_ros.decoding.inputs import ecosystem_processor
    processor = ecosystem_processor(path)
    if processor is None:
        pytest.skip("Qwen2VLProcessor needs torchvision and qwen_vl_utils (present on a Jetson or a GPU server, "
                    "not on this CPU machine's torch build)")
    return processor


@pytest.mark.parametrize("shape", [(112, 112), (720, 1280), (480, 640)])
def test_the_projects_inputs_equal_qwen_vl_utils_and_the_qwen2vl_processor(shape):
    """Where torchvision exists the drafter builds its prompt with qwen_vl_utils and AutoProcessor;
    elsewhere with build_inputs. Both must give the same tensors, at the model's bounds and at
    the drafter's tighter max_pixels."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from edgespec_ros.decoding.inputs import build_inputs, encode_jpeg
    path = default_model_path("draft")
    processor = _ecosystem_or_skip(path)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    own = AutoImageProcessor.from_pretrained(path, local_files_only=True)
    jpeg = encode_jpeg(_frame(*shape))
    for max_pixels in (0, 56 * 112):
        if max_pixels:
            limit_pixels(own, max_pixels=max_pixels)
            limit_pixels(processor.image_processor, max_pixels=max_pixels)
        ours = build_inputs(tokenizer, "find the silver bottle", jpeg, own)
        theirs = build_inputs(tokenizer, "find the silver bottle", jpeg, own, processor=processor)
        for name in ("input_ids", "attention_mask", "image_grid_thw", "mm_token_type_ids"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
        torch.testing.assert_close(ours.pixel_values, theirs.pixel_values, rtol=0, atol=1e-6)
