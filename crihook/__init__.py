"""crihook: fine-grained GPU and RDMA scheduling for Kubernetes at the container runtime boundary."""

__version__ = "0.1.0"
