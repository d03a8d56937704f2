// Command kubevirt-crds prints, as one multi-document YAML stream, the CustomResourceDefinitions
// of the KubeVirt kinds the ipwarden tests use (VirtualMachine, VirtualMachineInstance,
// VirtualMachineInstanceMigration), built by KubeVirt's own constructors so the tests install
// exactly what virt-operator installs.
package main

import (
	"fmt"
	"os"

	extv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/components"
	"sigs.k8s.io/yaml"
)

func main() {
	constructors := []func() (*extv1.CustomResourceDefinition, error){
		components.NewVirtualMachineCrd,
		components.NewVirtualMachineInstanceCrd,
		components.NewVirtualMachineInstanceMigrationCrd,
	}
	for _, construct := range constructors {
		crd, err := construct()
		if err != nil {
			fmt.Fprintf(os.Stderr, "kubevirt-crds: building a CRD: %v\n", err)
			os.Exit(1)
		}
		crd.TypeMeta.APIVersion = "apiextensions.k8s.io/v1"
		crd.TypeMeta.Kind = "CustomResourceDefinition"
		out, err := yaml.Marshal(crd)
		if err != nil {
			fmt.Fprintf(os.Stderr, "kubevirt-crds: encoding CRD %s: %v\n", crd.Name, err)
			os.Exit(1)
		}
		fmt.Printf("---\n%s", out)
	}
}
