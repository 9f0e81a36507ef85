"""What the tests share: the fakes (API server, NVML, hook servers), the real containerd and crihook
daemons they start, kubelet's part played over CRI, and the fixtures."""
