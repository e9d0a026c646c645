"""ROS I/O without rclpy: every topic's default name (``topics``), camera images to and from ROS
messages (``imaging``), and recordings as rosbag2 MCAP bags (``bags``). The nodes, the simulator,
the bring-up and the benchmarks' bag replay share them; none needs a ROS installation."""
