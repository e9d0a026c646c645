"""camera: frames from an OpenCV source -> sensor_msgs/Image (bgr8) and CompressedImage (JPEG).

The source is a device index, a video file, a URL or a GStreamer pipeline (the Go2's H.264
multicast, which needs an OpenCV built with GStreamer, as the Jetson's system OpenCV is). Each
frame is stamped when it is grabbed: that capture stamp travels through the drafter into the
decision, so latency is measured from it. On a Go2 running go2_ros2_sdk you do not need this
node: point the drafter at its ``camera/image_raw``.
"""
from __future__ import annotations

import threading

from rclpy.callback_groups import ReentrantCallbackGroup
from rclpy.node import Node
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image

from ..rosio.imaging import jpeg_bytes, parse_camera_source
from ..rosio import topics
from . import params
from .common import SENSOR_QOS, declare_parameters, now_ns, ns_to_time, rgb_to_image, run_node


def open_capture(source: str):
    """An opened cv2.VideoCapture for ``source``; RuntimeError says why it cannot be opened."""
    import cv2
    src = parse_camera_source(source)
    if src.kind == "gstreamer":
        if "GStreamer:                   YES" not in cv2.getBuildInformation():
            raise RuntimeError("this OpenCV has no GStreamer support, so the pipeline source cannot be opened; "
                               "use the system OpenCV (python3-opencv on the Jetson) or a device/file source")
        capture = cv2.VideoCapture(src.value, cv2.CAP_GSTREAMER)
    else:
        capture = cv2.VideoCapture(src.value)
    if not capture.isOpened():
        raise RuntimeError(f"cannot open camera source {source!r} ({src.kind})")
    return capture, src


class CameraNode(Node):
    def __init__(self, **kwargs):
        super().__init__("camera", **kwargs)
        p = self.p = declare_parameters(self, params.CAMERA)
        self.capture, self.source = open_capture(p["source"])
        qos = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE) if p["reliable"] else SENSOR_QOS
        self.image_pub = self.create_publisher(Image, topics.IMAGE, qos)
        self.compressed_pub = self.create_publisher(CompressedImage, topics.IMAGE_COMPRESSED, qos) \
            if p["publish_compressed"] else None
        self._lock = threading.Lock()
        self.frames = 0
        self.create_timer(1.0 / p["rate_hz"], self.on_timer, callback_group=ReentrantCallbackGroup())
        self.get_logger().info(f"camera: {self.source.kind} source {p['source']!r} at {p['rate_hz']:g} Hz")

    def on_timer(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # the previous read still waits for its frame: skip this tick
        try:
            if self.capture is None:
                return
            ok, bgr = self.capture.read()
            stamp = now_ns(self)  # capture time: right after the grab
            if not ok and self.source.kind == "file" and self.p["loop_video"]:
                import cv2
                self.capture.set(cv2.CAP_PROP_POS_FRAMES, 0)
                ok, bgr = self.capture.read()
                stamp = now_ns(self)
        finally:
            self._lock.release()
        if not ok:
            self.get_logger().warning("no frame from the camera source", throttle_duration_sec=5.0)
            return
        rgb = bgr[:, :, ::-1]
        self.image_pub.publish(rgb_to_image(rgb, stamp, self.p["frame_id"], encoding="bgr8"))
        if self.compressed_pub is not None:
            msg = CompressedImage()
            msg.header.stamp = ns_to_time(stamp)
            msg.header.frame_id = self.p["frame_id"]
            msg.format = "jpeg"
            msg.data = jpeg_bytes(rgb, self.p["jpeg_quality"])
            self.compressed_pub.publish(msg)
        self.frames += 1

    def close(self) -> None:
        with self._lock:
            if self.capture is not None:
                self.capture.release()
                self.capture = None


def main(args=None) -> int:
    return run_node(CameraNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
