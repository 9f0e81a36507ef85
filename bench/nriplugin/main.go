// The smallest useful NRI plugin, on containerd's own stub library: it answers every
// CreateContainer with one env adjustment. bench/nri_bench.py builds it (never committed as a
// binary) and registers it with a containerd of its own, beside crihook nri on another: the cost of
// NRI itself, which any plugin starts from.
//
//	go build -o PATH . && PATH -socket /run/nri/nri.sock -name gobench -idx 10
package main

import (
	"context"
	"flag"
	"log"

	"github.com/containerd/nri/pkg/api"
	"github.com/containerd/nri/pkg/stub"
)

type plugin struct{}

func (p *plugin) CreateContainer(_ context.Context, _ *api.PodSandbox, _ *api.Container) (*api.ContainerAdjustment, []*api.ContainerUpdate, error) {
	adjust := &api.ContainerAdjustment{}
	adjust.AddEnv("NRI_BENCH", "1")
	return adjust, nil, nil
}

func main() {
	socket := flag.String("socket", "/var/run/nri/nri.sock", "the runtime's NRI socket")
	name := flag.String("name", "gobench", "plugin name")
	idx := flag.String("idx", "10", "plugin index, two digits")
	flag.Parse()
	s, err := stub.New(&plugin{}, stub.WithPluginName(*name), stub.WithPluginIdx(*idx), stub.WithSocketPath(*socket))
	if err != nil {
		log.Fatalf("stub: %v", err)
	}
	if err := s.Run(context.Background()); err != nil {
		log.Fatalf("run: %v", err)
	}
}
