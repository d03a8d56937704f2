// Command whereabouts-controller runs Whereabouts' ip-control-loop (the pod controller that
// frees a deleted pod's IPs on its node) and its IP reconciler against a cluster named by a
// kubeconfig. Whereabouts' own main reads in-cluster configuration and a cron file mounted from
// a ConfigMap; this program calls the same exported constructors and loops with a kubeconfig
// and a fixed reconcile interval instead, so the e2e harness can run it as a process per node.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	nadclient "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/client/clientset/versioned"
	nadinformers "github.com/k8snetworkplumbingwg/network-attachment-definition-client/pkg/client/informers/externalversions"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"

	"github.com/k8snetworkplumbingwg/whereabouts/pkg/controlloop"
	wbclient "github.com/k8snetworkplumbingwg/whereabouts/pkg/generated/clientset/versioned"
	wbinformers "github.com/k8snetworkplumbingwg/whereabouts/pkg/generated/informers/externalversions"
	"github.com/k8snetworkplumbingwg/whereabouts/pkg/logging"
	"github.com/k8snetworkplumbingwg/whereabouts/pkg/reconciler"
	wbstorage "github.com/k8snetworkplumbingwg/whereabouts/pkg/storage/kubernetes"
)

// readyLine is printed once the pod controller's caches are synced.
const readyLine = "whereabouts-controller: caches synced"

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the cluster")
	node := flag.String("node-name", "", "the Node whose deleted pods this ip-control-loop handles")
	interval := flag.Duration("reconcile-interval", time.Minute, "how often the IP reconciler runs")
	logLevel := flag.String("log-level", "verbose", "Whereabouts' log level")
	flag.Parse()
	logging.SetLogLevel(*logLevel)
	logging.SetLogStderr(true)
	if err := run(*kubeconfig, *node, *interval); err != nil {
		fmt.Fprintf(os.Stderr, "whereabouts-controller: %v\n", err)
		os.Exit(1)
	}
}

func run(kubeconfig, node string, interval time.Duration) error {
	if kubeconfig == "" || node == "" {
		return fmt.Errorf("--kubeconfig and --node-name are required")
	}
	// controlloop.PodInformerFactory reads the node from the environment, as in the DaemonSet.
	if err := os.Setenv("NODENAME", node); err != nil {
		return err
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("loading %s: %w", kubeconfig, err)
	}
	k8s, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	nads, err := nadclient.NewForConfig(cfg)
	if err != nil {
		return err
	}
	wb, err := wbclient.NewForConfig(cfg)
	if err != nil {
		return err
	}
	podInformers, err := controlloop.PodInformerFactory(k8s)
	if err != nil {
		return err
	}
	poolInformers := wbinformers.NewSharedInformerFactory(wb, 0)
	nadInformers := nadinformers.NewSharedInformerFactory(nads, 0)
	broadcaster := record.NewBroadcaster()
	broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: k8s.CoreV1().Events("")})
	recorder := broadcaster.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "pod-ip-controlloop"})
	controller := controlloop.NewPodController(k8s, wb, podInformers, poolInformers, nadInformers, broadcaster, recorder)

	stop := make(chan struct{})
	podInformers.Start(stop)
	nadInformers.Start(stop)
	poolInformers.Start(stop)
	controller.Start(stop)
	defer controller.Shutdown()
	// The harness waits for this line: the informers have listed the cluster.
	fmt.Fprintln(os.Stderr, readyLine)

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, os.Interrupt, syscall.SIGTERM)
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		select {
		case <-signals:
			close(stop)
			return nil
		case <-ticker.C:
			reconcile(kubeconfig)
		}
	}
}

// reconcile is one run of Whereabouts' reconciler (reconciler.ReconcileIPs with a kubeconfig).
func reconcile(kubeconfig string) {
	client, err := wbstorage.NewClientViaKubeconfig(kubeconfig)
	if err != nil {
		_ = logging.Errorf("reconciler: client: %v", err)
		return
	}
	looper, err := reconciler.NewReconcileLooperWithClient(client)
	if err != nil {
		_ = logging.Errorf("reconciler: %v", err)
		return
	}
	cleaned, err := looper.ReconcileIPPools()
	if err != nil {
		_ = logging.Errorf("reconciler: cleaning up IP pools: %v", err)
	}
	logging.Verbosef("reconciler: released %d IPs: %v", len(cleaned), cleaned)
	if err := looper.ReconcileOverlappingIPAddresses(); err != nil {
		_ = logging.Errorf("reconciler: overlapping reservations: %v", err)
	}
}
