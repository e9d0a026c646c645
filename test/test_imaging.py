"""Image conversions without cv_bridge, camera source parsing, annotated frames."""
import numpy as np
import pytest

from edgespec_ros.rosio.imaging import (ImageFormatError, annotate, jpeg_bytes, parse_camera_source, raw_from_rgb,
                                  rgb_from_compressed, rgb_from_raw)

RGB = (np.arange(4 * 5 * 3) % 256).astype(np.uint8).reshape(4, 5, 3)


@pytest.mark.parametrize("encoding", ["rgb8", "bgr8"])
def test_raw_round_trip(encoding):
    h, w, step, data = raw_from_rgb(RGB, encoding)
    assert (h, w, step, len(data)) == (4, 5, 15, 60)
    assert np.array_equal(rgb_from_raw(encoding, h, w, step, data), RGB)


def test_bgr_really_swaps_and_padding_is_skipped():
    bgr = RGB[:, :, ::-1]
    padded = np.zeros((4, 16), np.uint8)
    padded[:, :15] = bgr.reshape(4, 15)
    assert np.array_equal(rgb_from_raw("bgr8", 4, 5, 16, padded.tobytes()), RGB)
    rgba = np.concatenate([RGB, np.full((4, 5, 1), 255, np.uint8)], axis=2)
    assert np.array_equal(rgb_from_raw("rgba8", 4, 5, 20, rgba.tobytes()), RGB)
    mono = rgb_from_raw("mono8", 4, 5, 5, RGB[:, :, 0].tobytes())
    assert np.array_equal(mono[:, :, 2], RGB[:, :, 0])


def test_bad_images_are_refused_with_reasons():
    with pytest.raises(ImageFormatError, match="unsupported image encoding '16UC1'"):
        rgb_from_raw("16UC1", 4, 5, 10, b"\0" * 40)
    with pytest.raises(ImageFormatError, match="expected step\\*height"):
        rgb_from_raw("rgb8", 4, 5, 15, b"\0" * 10)
    with pytest.raises(ImageFormatError, match="step 10"):
        rgb_from_raw("rgb8", 4, 5, 10, b"\0" * 60)
    with pytest.raises(ImageFormatError, match="compressed"):
        rgb_from_compressed(b"not a jpeg")


def test_jpeg_round_trip():
    image = np.full((16, 16, 3), (200, 30, 30), np.uint8)
    back = rgb_from_compressed(jpeg_bytes(image))
    assert back.shape == (16, 16, 3) and np.abs(back.astype(int) - image).max() < 12


def test_camera_sources():
    assert parse_camera_source("0").kind == "device" and parse_camera_source("2").value == 2
    go2 = "udpsrc address=230.1.1.1 port=1720 ! application/x-rtp ! rtph264depay ! avdec_h264 ! appsink"
    assert parse_camera_source(go2).kind == "gstreamer"
    assert parse_camera_source("rtsp://cam/stream").kind == "url"
    assert parse_camera_source("/data/walk.mp4").kind == "file"
    with pytest.raises(ValueError, match="empty"):
        parse_camera_source("  ")


def test_annotate_scales_and_adds_a_caption():
    out = annotate(np.zeros((112, 112, 3), np.uint8), "action: turn left small",
                   ["The bottle is on the left. " * 5, "mode sd | latency 420 ms"], width=448)
    assert out.shape[1] == 448 and out.shape[0] > 448
    assert out[:448].max() == 0          # the frame, scaled
    assert out[448:].max() > 200          # text was drawn in the band
