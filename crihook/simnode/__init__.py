"""A simulated GPU node for `crihook demo`, development and the tests: a fake `libnvidia-ml.so.1`
built from C source (fakenvml), the node's sysfs and /dev trees (node), a CRI client playing kubelet
(cri), `crihook serve` run as a child process (daemon) and a private containerd with offline images
(containerd). Nothing here is used by the daemons."""
