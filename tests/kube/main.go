// Command kube is kube-apiserver, kube-controller-manager, kube-scheduler and kubelet in one
// link, built from the k8s.io/kubernetes module for the cluster tests (tests/kube/build.sh). The
// first argument names the component; the rest are its own flags.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

var components = map[string]func() *cobra.Command{
	"kube-apiserver":          func() *cobra.Command { return apiserver.NewAPIServerCommand() },
	"kube-controller-manager": func() *cobra.Command { return controllermanager.NewControllerManagerCommand() },
	"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
	"kubelet":                 func() *cobra.Command { return kubelet.NewKubeletCommand(context.Background()) },
}

func main() {
	if len(os.Args) < 2 || components[os.Args[1]] == nil {
		fmt.Fprintln(os.Stderr, "usage: kube kube-apiserver|kube-controller-manager|kube-scheduler|kubelet [flags]")
		os.Exit(2)
	}
	command := components[os.Args[1]]()
	os.Args = append(os.Args[:1], os.Args[2:]...)
	os.Exit(cli.Run(command))
}
