package kubernetes

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"net"
	"os"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"go.uber.org/goleak"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/util/validation"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"

	"github.com/faultline-ml/faultline/topology"
	"github.com/faultline-ml/faultline/trace"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// manifests are the example's objects, decoded from every *.yaml file
// but kustomization.yaml.
type manifests struct {
	files      []string // the manifest files, sorted
	objects    []runtime.Object
	namespace  *corev1.Namespace
	job        *batchv1.Job
	deployment *appsv1.Deployment
	services   map[string]*corev1.Service
	configMaps map[string]*corev1.ConfigMap
	secrets    map[string]*corev1.Secret
	claims     map[string]*corev1.PersistentVolumeClaim
	accounts   map[string]*corev1.ServiceAccount
	roles      map[string]*rbacv1.Role
	bindings   map[string]*rbacv1.RoleBinding
}

// load decodes the manifests strictly: an unknown or duplicate field is an
// error, as kubectl apply --validate=strict makes it.
func load(t testing.TB) *manifests {
	t.Helper()
	files, err := filepath.Glob("*.yaml")
	if err != nil {
		t.Fatal(err)
	}
	m := &manifests{services: map[string]*corev1.Service{}, configMaps: map[string]*corev1.ConfigMap{},
		secrets: map[string]*corev1.Secret{}, claims: map[string]*corev1.PersistentVolumeClaim{}, accounts: map[string]*corev1.ServiceAccount{},
		roles: map[string]*rbacv1.Role{}, bindings: map[string]*rbacv1.RoleBinding{}}
	dec := serializer.NewCodecFactory(scheme.Scheme, serializer.EnableStrict).UniversalDeserializer()
	seen := map[string]string{} // kind/name -> file
	for _, file := range files {
		if file == "kustomization.yaml" {
			continue
		}
		m.files = append(m.files, file)
		data, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
		for n := 1; ; n++ {
			doc, err := r.Read()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("%s: document %d: %v", file, n, err)
			}
			if onlyComments(doc) {
				continue
			}
			obj, gvk, err := dec.Decode(doc, nil, nil)
			if err != nil {
				t.Fatalf("%s: document %d: %v", file, n, err)
			}
			key := gvk.Kind + "/" + name(obj)
			if prev, ok := seen[key]; ok {
				t.Fatalf("%s: %s again, first in %s", file, key, prev)
			}
			seen[key] = file
			m.objects = append(m.objects, obj)
			switch o := obj.(type) {
			case *corev1.Namespace:
				m.namespace = o
			case *batchv1.Job:
				if m.job != nil {
					t.Fatalf("%s: a second Job, %s", file, o.Name)
				}
				m.job = o
			case *appsv1.Deployment:
				if m.deployment != nil {
					t.Fatalf("%s: a second Deployment, %s", file, o.Name)
				}
				m.deployment = o
			case *corev1.Service:
				m.services[o.Name] = o
			case *corev1.ConfigMap:
				m.configMaps[o.Name] = o
			case *corev1.Secret:
				m.secrets[o.Name] = o
			case *corev1.PersistentVolumeClaim:
				m.claims[o.Name] = o
			case *corev1.ServiceAccount:
				m.accounts[o.Name] = o
			case *rbacv1.Role:
				m.roles[o.Name] = o
			case *rbacv1.RoleBinding:
				m.bindings[o.Name] = o
			default:
				t.Fatalf("%s: document %d: a %s, which these tests do not check", file, n, gvk.Kind)
			}
		}
	}
	if m.namespace == nil || m.job == nil || m.deployment == nil {
		t.Fatalf("the manifests lack a Namespace, a Job or a Deployment")
	}
	return m
}

func onlyComments(doc []byte) bool {
	for line := range strings.Lines(string(doc)) {
		if s := strings.TrimSpace(line); s != "" && s != "---" && !strings.HasPrefix(s, "#") {
			return false
		}
	}
	return true
}

func name(obj runtime.Object) string {
	type named interface{ GetName() string }
	if o, ok := obj.(named); ok {
		return o.GetName()
	}
	return ""
}

// templates are the pod templates of the Job and the Deployment, by
// "Kind/name".
func (m *manifests) templates() map[string]*corev1.PodTemplateSpec {
	return map[string]*corev1.PodTemplateSpec{
		"Job/" + m.job.Name:               &m.job.Spec.Template,
		"Deployment/" + m.deployment.Name: &m.deployment.Spec.Template,
	}
}

func TestManifestsDecode(t *testing.T) {
	m := load(t)
	ns := m.namespace.Name
	for _, obj := range m.objects {
		o := obj.(interface {
			GetName() string
			GetNamespace() string
		})
		if errs := validation.IsDNS1123Subdomain(o.GetName()); len(errs) > 0 {
			t.Errorf("%T %q: %v", obj, o.GetName(), errs)
		}
		if _, isNS := obj.(*corev1.Namespace); !isNS && o.GetNamespace() != ns {
			t.Errorf("%T %s is in namespace %q, not %q", obj, o.GetName(), o.GetNamespace(), ns)
		}
	}
}

// TestKustomization: kustomization.yaml applies every manifest, in the
// manifests' namespace.
func TestKustomization(t *testing.T) {
	m := load(t)
	data, err := os.ReadFile("kustomization.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		APIVersion string   `json:"apiVersion"`
		Kind       string   `json:"kind"`
		Namespace  string   `json:"namespace"`
		Resources  []string `json:"resources"`
	}
	if err := utilyaml.UnmarshalStrict(data, &k); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	if k.Kind != "Kustomization" || k.Namespace != m.namespace.Name {
		t.Errorf("kustomization.yaml: kind %q, namespace %q; want Kustomization and %q", k.Kind, k.Namespace, m.namespace.Name)
	}
	if got := slices.Sorted(slices.Values(k.Resources)); !slices.Equal(got, m.files) {
		t.Errorf("kustomization.yaml lists %v, the manifests are %v", got, m.files)
	}
	if k.Resources[0] != "namespace.yaml" {
		t.Errorf("kustomization.yaml lists %s first, not the namespace", k.Resources[0])
	}
}

// TestServicesSelectTheirPods: each Service selects the pods of one
// template, and its ports lead to ports of that template's containers;
// the headless Service gives the Job's pods their names.
func TestServicesSelectTheirPods(t *testing.T) {
	m := load(t)
	selected := map[string]string{} // Service -> template
	for _, svc := range m.services {
		sel := labels.SelectorFromSet(svc.Spec.Selector)
		var matched []string
		for key, tpl := range m.templates() {
			if len(svc.Spec.Selector) > 0 && sel.Matches(labels.Set(tpl.Labels)) {
				matched = append(matched, key)
			}
		}
		if len(matched) != 1 {
			t.Errorf("Service %s selects %v, want the pods of one template", svc.Name, matched)
			continue
		}
		selected[svc.Name] = matched[0]
		tpl := m.templates()[matched[0]]
		for _, p := range svc.Spec.Ports {
			cp, ok := containerPort(tpl, p.TargetPort.String())
			switch {
			case !ok:
				t.Errorf("Service %s port %s: targetPort %s is no port of %s", svc.Name, p.Name, p.TargetPort.String(), matched[0])
			case svc.Spec.ClusterIP == corev1.ClusterIPNone && cp.ContainerPort != p.Port:
				t.Errorf("headless Service %s port %s is %d, its pods' %d: a pod's name leads to the pod itself", svc.Name, p.Name, p.Port, cp.ContainerPort)
			}
		}
	}
	job := m.job
	svc, ok := m.services[job.Spec.Template.Spec.Subdomain]
	switch {
	case !ok:
		t.Fatalf("the Job's subdomain %q is no Service", job.Spec.Template.Spec.Subdomain)
	case svc.Spec.ClusterIP != corev1.ClusterIPNone:
		t.Errorf("Service %s, the Job's subdomain, is not headless", svc.Name)
	case !svc.Spec.PublishNotReadyAddresses:
		t.Errorf("Service %s does not publish pods before they are ready: rank 0's name would not resolve at start", svc.Name)
	case selected[svc.Name] != "Job/"+job.Name:
		t.Errorf("Service %s selects %s, not the Job's pods", svc.Name, selected[svc.Name])
	}
	if job.Spec.CompletionMode == nil || *job.Spec.CompletionMode != batchv1.IndexedCompletion {
		t.Errorf("the Job is not Indexed: its pods have no index to be the node rank")
	}
	if job.Spec.Completions == nil || job.Spec.Parallelism == nil || *job.Spec.Completions != *job.Spec.Parallelism {
		t.Errorf("the Job's completions and parallelism differ: not every node would run at once")
	}
	d := m.deployment
	if !labels.SelectorFromSet(d.Spec.Selector.MatchLabels).Matches(labels.Set(d.Spec.Template.Labels)) || len(d.Spec.Selector.MatchExpressions) > 0 {
		t.Errorf("Deployment %s's selector does not select its template", d.Name)
	}
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 2 || d.Spec.Strategy.Type != appsv1.RecreateDeploymentStrategyType {
		t.Errorf("Deployment %s: want 2 replicas and the Recreate strategy", d.Name)
	}
	for _, c := range d.Spec.Template.Spec.Containers {
		if p := c.ReadinessProbe; p == nil || p.TCPSocket == nil {
			t.Errorf("Deployment %s: container %s has no TCP readiness probe: the standby would get traffic", d.Name, c.Name)
		} else if _, ok := containerPort(&d.Spec.Template, p.TCPSocket.Port.String()); !ok {
			t.Errorf("Deployment %s: the readiness probe's port %s is not the container's", d.Name, p.TCPSocket.Port.String())
		}
	}
}

// containerPort finds a port of tpl's containers by name or number.
func containerPort(tpl *corev1.PodTemplateSpec, port string) (corev1.ContainerPort, bool) {
	for _, c := range tpl.Spec.Containers {
		for _, p := range c.Ports {
			if p.Name == port || strconv.Itoa(int(p.ContainerPort)) == port {
				return p, true
			}
		}
	}
	return corev1.ContainerPort{}, false
}

// downwardFields are the fieldRef paths that the downward API serves to
// environment variables (metadata.labels['...'] and annotations too).
var downwardFields = []string{"metadata.name", "metadata.namespace", "metadata.uid", "spec.nodeName",
	"spec.serviceAccountName", "status.hostIP", "status.hostIPs", "status.podIP", "status.podIPs"}

var downwardKey = regexp.MustCompile(`^metadata\.(labels|annotations)\['([^']+)'\]$`)

// TestMountsAndReferences: every volume mount names a volume, every
// volume and environment variable names a ConfigMap, Secret and key that
// exist, every downward API path is one the kubelet serves, every pod's
// ServiceAccount exists, and the ConfigMaps hold what their readers parse.
func TestMountsAndReferences(t *testing.T) {
	m := load(t)
	for key, tpl := range m.templates() {
		spec := &tpl.Spec
		if _, ok := m.accounts[spec.ServiceAccountName]; !ok {
			t.Errorf("%s: ServiceAccount %q does not exist", key, spec.ServiceAccountName)
		}
		vols := map[string]corev1.Volume{}
		for _, v := range spec.Volumes {
			vols[v.Name] = v
			switch {
			case v.ConfigMap != nil:
				cm, ok := m.configMaps[v.ConfigMap.Name]
				if !ok {
					t.Errorf("%s: volume %s: ConfigMap %s does not exist", key, v.Name, v.ConfigMap.Name)
				}
				for _, it := range v.ConfigMap.Items {
					if _, ok := cm.Data[it.Key]; cm != nil && !ok {
						t.Errorf("%s: volume %s: ConfigMap %s has no key %s", key, v.Name, cm.Name, it.Key)
					}
				}
			case v.Secret != nil:
				if _, ok := m.secrets[v.Secret.SecretName]; !ok {
					t.Errorf("%s: volume %s: Secret %s does not exist", key, v.Name, v.Secret.SecretName)
				}
			}
		}
		for _, c := range spec.Containers {
			paths := map[string]bool{}
			for _, vm := range c.VolumeMounts {
				if _, ok := vols[vm.Name]; !ok {
					t.Errorf("%s: container %s mounts volume %s, which the pod lacks", key, c.Name, vm.Name)
				}
				if paths[vm.MountPath] {
					t.Errorf("%s: container %s mounts two volumes at %s", key, c.Name, vm.MountPath)
				}
				paths[vm.MountPath] = true
				if v := vols[vm.Name]; (v.ConfigMap != nil || v.Secret != nil) && vm.SubPath != "" {
					t.Errorf("%s: container %s mounts %s with a subPath, which the kubelet never updates", key, c.Name, vm.Name)
				}
			}
			for _, e := range c.Env {
				switch f := e.ValueFrom; {
				case f == nil:
				case f.FieldRef != nil:
					p := f.FieldRef.FieldPath
					if !slices.Contains(downwardFields, p) && !downwardKey.MatchString(p) {
						t.Errorf("%s: env %s: the downward API serves no %q", key, e.Name, p)
					}
				case f.ConfigMapKeyRef != nil:
					if cm, ok := m.configMaps[f.ConfigMapKeyRef.Name]; !ok || cm.Data[f.ConfigMapKeyRef.Key] == "" {
						t.Errorf("%s: env %s: ConfigMap %s key %s does not exist", key, e.Name, f.ConfigMapKeyRef.Name, f.ConfigMapKeyRef.Key)
					}
				case f.SecretKeyRef != nil:
					if !m.secretHas(f.SecretKeyRef.Name, f.SecretKeyRef.Key) {
						t.Errorf("%s: env %s: Secret %s key %s does not exist", key, e.Name, f.SecretKeyRef.Name, f.SecretKeyRef.Key)
					}
				}
			}
		}
	}
	for _, cm := range m.configMaps {
		for k, v := range cm.Data {
			var err error
			switch k {
			case "profilingSwitch":
				_, err = trace.ParseSwitch([]byte(v))
			case "topology_config":
				_, err = topology.Parse([]byte(v))
			default:
				err = errors.New("no reader of this key is known")
			}
			if err != nil {
				t.Errorf("ConfigMap %s key %s: %v", cm.Name, k, err)
			}
		}
	}
}

// secretHas reports whether Secret name holds key.
func (m *manifests) secretHas(name, key string) bool {
	s, ok := m.secrets[name]
	if !ok {
		return false
	}
	_, inData := s.Data[key]
	_, inString := s.StringData[key]
	return inData || inString
}

// mountedFile returns the volume and key that a file path of container c
// of tpl reads: the Secret or ConfigMap whose mount holds path.
func mountedFile(tpl *corev1.PodTemplateSpec, c *corev1.Container, file string) (corev1.Volume, string, bool) {
	for _, vm := range c.VolumeMounts {
		if path.Dir(file) != path.Clean(vm.MountPath) {
			continue
		}
		for _, v := range tpl.Spec.Volumes {
			if v.Name == vm.Name {
				return v, path.Base(file), true
			}
		}
	}
	return corev1.Volume{}, "", false
}

// TestRBAC: the manager's ServiceAccount is bound to its Role and the
// trainers' to nothing; nothing is granted cluster-wide or by wildcard.
// TestRoleGrantsWhatIsUsed checks that the Role grants what the executor
// and the Lease do, and nothing more.
func TestRBAC(t *testing.T) {
	m := load(t)
	bound := map[string]bool{}
	for _, b := range m.bindings {
		if b.RoleRef.Kind != "Role" || b.RoleRef.APIGroup != rbacv1.GroupName {
			t.Errorf("RoleBinding %s refers to a %s, not a Role", b.Name, b.RoleRef.Kind)
		} else if _, ok := m.roles[b.RoleRef.Name]; !ok {
			t.Errorf("RoleBinding %s: Role %s does not exist", b.Name, b.RoleRef.Name)
		}
		for _, s := range b.Subjects {
			if s.Kind != rbacv1.ServiceAccountKind || s.Namespace != b.Namespace {
				t.Errorf("RoleBinding %s: subject %s %s/%s is not a ServiceAccount of its namespace", b.Name, s.Kind, s.Namespace, s.Name)
			} else if _, ok := m.accounts[s.Name]; !ok {
				t.Errorf("RoleBinding %s: ServiceAccount %s does not exist", b.Name, s.Name)
			}
			bound[s.Name] = true
		}
	}
	for _, r := range m.roles {
		for _, rule := range r.Rules {
			for _, s := range slices.Concat(rule.APIGroups, rule.Resources, rule.Verbs, rule.ResourceNames) {
				if strings.Contains(s, "*") {
					t.Errorf("Role %s grants a wildcard: %+v", r.Name, rule)
				}
			}
			if len(rule.NonResourceURLs) > 0 {
				t.Errorf("Role %s grants URLs: %v", r.Name, rule.NonResourceURLs)
			}
		}
	}
	manager := m.deployment.Spec.Template.Spec
	if !bound[manager.ServiceAccountName] {
		t.Errorf("the managers' ServiceAccount %s is bound to no Role", manager.ServiceAccountName)
	}
	trainer := m.job.Spec.Template.Spec
	sa := m.accounts[trainer.ServiceAccountName]
	switch {
	case bound[trainer.ServiceAccountName]:
		t.Errorf("the trainers' ServiceAccount %s is bound to a Role: they need none", trainer.ServiceAccountName)
	case trainer.AutomountServiceAccountToken == nil || *trainer.AutomountServiceAccountToken:
		t.Errorf("the trainers' pods mount a ServiceAccount token")
	case sa == nil || sa.AutomountServiceAccountToken == nil || *sa.AutomountServiceAccountToken:
		t.Errorf("the trainers' ServiceAccount %s mounts its token", trainer.ServiceAccountName)
	}
}

// flagSet is the flags of a command: name -> whether it takes a value.
type flagSet map[string]bool

// flagsOf reads the flags that a command's main.go defines: the names
// given to the flag package's definers (fs.String("name", ...),
// flag.BoolVar(&v, "name", ...)); false if there is no such file.
func flagsOf(t *testing.T, file string) (flagSet, bool) {
	t.Helper()
	f, err := parser.ParseFile(token.NewFileSet(), file, nil, 0)
	if errors.Is(err, os.ErrNotExist) {
		return nil, false
	}
	if err != nil {
		t.Fatal(err)
	}
	flags := flagSet{}
	ast.Inspect(f, func(n ast.Node) bool {
		call, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		sel, ok := call.Fun.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		fn := sel.Sel.Name
		arg := 0
		switch fn {
		case "Bool", "String", "Int", "Int64", "Uint", "Uint64", "Float64", "Duration", "Func", "TextVar":
		case "BoolVar", "StringVar", "IntVar", "Int64Var", "UintVar", "Uint64Var", "Float64Var", "DurationVar", "Var":
			arg = 1
		default:
			return true
		}
		if len(call.Args) <= arg {
			return true
		}
		if lit, ok := call.Args[arg].(*ast.BasicLit); ok && lit.Kind == token.STRING {
			name, _ := strconv.Unquote(lit.Value)
			flags[name] = fn != "Bool" && fn != "BoolVar"
		}
		return true
	})
	return flags, true
}

// parseFlags reads args as the flag package does: flags up to the first
// argument that is not one, or "--"; it returns the flags' values and the
// rest.
func parseFlags(args []string, known flagSet) (map[string]string, []string, error) {
	vals := map[string]string{}
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			return vals, args[i+1:], nil
		}
		if len(a) < 2 || a[0] != '-' {
			return vals, args[i:], nil
		}
		name, val, hasVal := strings.Cut(strings.TrimPrefix(strings.TrimPrefix(a, "-"), "-"), "=")
		takes, ok := known[name]
		switch {
		case !ok:
			return nil, nil, fmt.Errorf("flag --%s is not defined", name)
		case takes && !hasVal:
			if i+1 == len(args) {
				return nil, nil, fmt.Errorf("flag --%s needs a value", name)
			}
			i++
			val = args[i]
		case !takes && !hasVal:
			val = "true"
		}
		if _, dup := vals[name]; dup {
			return nil, nil, fmt.Errorf("flag --%s is given twice", name)
		}
		vals[name] = val
	}
	return vals, nil, nil
}

// command parses the command line of tpl's only container, which must be
// the command named cmd, with flags.
func command(t *testing.T, tpl *corev1.PodTemplateSpec, cmd string, flags flagSet) (*corev1.Container, map[string]string, []string) {
	t.Helper()
	if len(tpl.Spec.Containers) != 1 {
		t.Fatalf("%d containers, want 1", len(tpl.Spec.Containers))
	}
	c := &tpl.Spec.Containers[0]
	if !slices.Equal(c.Command, []string{cmd}) {
		t.Fatalf("container %s runs %v, want %s", c.Name, c.Command, cmd)
	}
	// $(VAR) in args is the container's variable VAR.
	env := map[string]bool{}
	for _, e := range c.Env {
		env[e.Name] = true
	}
	for _, a := range c.Args {
		for _, ref := range regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`).FindAllStringSubmatch(a, -1) {
			if !env[ref[1]] {
				t.Errorf("%s: argument %q refers to $(%s), which the container does not define", cmd, a, ref[1])
			}
		}
	}
	vals, rest, err := parseFlags(c.Args, flags)
	if err != nil {
		t.Fatalf("%s %v: %v", cmd, c.Args, err)
	}
	return c, vals, rest
}

// TestCommandLines: the flags given to faultline-run and taskd-manager
// are theirs, and their values agree with the objects they name: the
// Job's size, pod 0's name, the Services' names and ports, the mounted
// token and switch, the Lease the Role grants.
func TestCommandLines(t *testing.T) {
	m := load(t)
	runFlags, ok := flagsOf(t, "../faultline-run/main.go")
	if !ok {
		t.Fatal("examples/faultline-run/main.go is missing")
	}
	mgrFlags, ok := flagsOf(t, "../taskd-manager/main.go")
	if !ok {
		t.Fatal("examples/taskd-manager/main.go is missing")
	}
	jobTpl, mgrTpl := &m.job.Spec.Template, &m.deployment.Spec.Template
	run, rf, script := command(t, jobTpl, "faultline-run", runFlags)
	mgr, mf, rest := command(t, mgrTpl, "taskd-manager", mgrFlags)
	if len(rest) > 0 {
		t.Errorf("taskd-manager takes no arguments, given %v", rest)
	}
	if len(script) == 0 {
		t.Fatalf("faultline-run is given no script")
	}
	eq := func(what, got, want string) {
		t.Helper()
		if got != want {
			t.Errorf("%s = %q, want %q", what, got, want)
		}
	}

	nodes := strconv.Itoa(int(*m.job.Spec.Completions))
	eq("faultline-run --nnodes", rf["nnodes"], nodes)
	eq("taskd-manager --nodes", mf["nodes"], nodes)
	eq("taskd-manager --procs-per-node", mf["procs-per-node"], rf["nproc-per-node"])
	eq("taskd-manager --job", mf["job"], rf["rdzv-id"])
	if err := trace.ValidateJob(mf["job"]); err != nil {
		t.Error(err)
	}

	// The node rank is the pod's completion index.
	eq("faultline-run --node-rank", rf["node-rank"], "$(NODE_RANK)")
	for _, e := range run.Env {
		if e.Name == "NODE_RANK" && (e.ValueFrom == nil || e.ValueFrom.FieldRef == nil ||
			e.ValueFrom.FieldRef.FieldPath != "metadata.annotations['"+batchv1.JobCompletionIndexAnnotation+"']") {
			t.Errorf("NODE_RANK is not the pod's %s annotation: %+v", batchv1.JobCompletionIndexAnnotation, e.ValueFrom)
		}
	}
	// Rank 0's store: pod 0's name under the headless Service, its port.
	eq("faultline-run --master-addr", rf["master-addr"], m.job.Name+"-0."+jobTpl.Spec.Subdomain)
	if p, ok := containerPort(jobTpl, rf["master-port"]); !ok || m.services[jobTpl.Spec.Subdomain].Spec.Ports[0].Port != p.ContainerPort {
		t.Errorf("faultline-run --master-port %s is not the trainer's port in Service %s", rf["master-port"], jobTpl.Spec.Subdomain)
	}
	// The manager: its Service's name and port, which lead to its listener.
	host, port, err := net.SplitHostPort(rf["manager"])
	if err != nil {
		t.Fatalf("faultline-run --manager %q: %v", rf["manager"], err)
	}
	svc, ok := m.services[host]
	if !ok {
		t.Fatalf("faultline-run --manager %q: no Service %s", rf["manager"], host)
	}
	var target string
	for _, p := range svc.Spec.Ports {
		if strconv.Itoa(int(p.Port)) == port {
			target = p.TargetPort.String()
		}
	}
	_, listen, _ := net.SplitHostPort(mf["listen"])
	if cp, ok := containerPort(mgrTpl, target); !ok || strconv.Itoa(int(cp.ContainerPort)) != listen {
		t.Errorf("faultline-run --manager %s leads to port %q of the managers, which listen on %q", rf["manager"], target, mf["listen"])
	}
	// A manager apart recovers the agents' ranks only with their
	// orchestration.
	eq("taskd-manager --agents", mf["agents"], "true")
	_, metrics, _ := net.SplitHostPort(mf["metrics-listen"])
	if _, ok := containerPort(mgrTpl, metrics); !ok {
		t.Errorf("taskd-manager --metrics-listen %s is no container port", mf["metrics-listen"])
	}

	// Both read the token from the same Secret key.
	var secrets []string
	for _, side := range []struct {
		tpl  *corev1.PodTemplateSpec
		c    *corev1.Container
		file string
	}{{jobTpl, run, rf["token-file"]}, {mgrTpl, mgr, mf["token-file"]}} {
		v, key, ok := mountedFile(side.tpl, side.c, side.file)
		if !ok || v.Secret == nil || !m.secretHas(v.Secret.SecretName, key) {
			t.Errorf("%s --token-file %s is no key of a mounted Secret", side.c.Command[0], side.file)
			continue
		}
		secrets = append(secrets, v.Secret.SecretName+"/"+key)
	}
	if len(secrets) == 2 && secrets[0] != secrets[1] {
		t.Errorf("faultline-run reads the token from %s, taskd-manager from %s", secrets[0], secrets[1])
	}
	// The switch, where a SwitchWatcher looks for it by default.
	eq("taskd-manager --switch-file", mf["switch-file"], trace.DefaultSwitchPath)
	if v, key, ok := mountedFile(mgrTpl, mgr, mf["switch-file"]); !ok || v.ConfigMap == nil || m.configMaps[v.ConfigMap.Name].Data[key] == "" {
		t.Errorf("taskd-manager --switch-file %s is no key of a mounted ConfigMap", mf["switch-file"])
	}
	// The Lease, the one the Role lets the managers renew.
	eq("taskd-manager --lease", mf["lease"], "kubernetes")
	if names := leaseNames(m); !slices.Contains(names, mf["lease-name"]) {
		t.Errorf("taskd-manager --lease-name %q is not among the Leases the Role grants, %v", mf["lease-name"], names)
	}
	// The managers' state, on a volume every replica mounts at once.
	if v, _, ok := mountedFile(mgrTpl, mgr, path.Join(mf["state-dir"], "x")); !ok || v.PersistentVolumeClaim == nil ||
		m.claims[v.PersistentVolumeClaim.ClaimName] == nil ||
		!slices.Contains(m.claims[v.PersistentVolumeClaim.ClaimName].Spec.AccessModes, corev1.ReadWriteMany) {
		t.Errorf("taskd-manager --state-dir %q is not the mount of a ReadWriteMany PersistentVolumeClaim", mf["state-dir"])
	}
	// Where faultline-run writes is a mounted volume: the root is read-only.
	for _, dir := range []string{rf["out"], run.WorkingDir} {
		if !underMount(run, dir) {
			t.Errorf("faultline-run writes to %s, which is on no mounted volume", dir)
		}
	}
	if !underMount(run, "/dev/shm/x") {
		t.Errorf("/dev/shm, where the memory checkpoints go, is not a mounted volume")
	}

	// The image has both commands and the script.
	docker, err := os.ReadFile("Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"./examples/faultline-run", "./examples/taskd-manager", "/usr/local/bin/", " " + script[0] + "\n", "python3-torch"} {
		if !bytes.Contains(docker, []byte(s)) {
			t.Errorf("the Dockerfile has no %q", s)
		}
	}
	// The script's own flags, if its source is here.
	if src, err := os.ReadFile("../faultline-run/train.py"); err == nil {
		for _, a := range script[1:] {
			if strings.HasPrefix(a, "--") && !bytes.Contains(src, []byte(`add_argument("`+a+`"`)) {
				t.Errorf("train.py has no flag %s", a)
			}
		}
	}
}

// underMount reports whether file is under a volume mount of c.
func underMount(c *corev1.Container, file string) bool {
	for _, vm := range c.VolumeMounts {
		if rel, err := filepath.Rel(vm.MountPath, file); err == nil && !strings.HasPrefix(rel, "..") {
			return true
		}
	}
	return false
}

// leaseNames returns the Leases that the managers' Roles grant by name.
func leaseNames(m *manifests) []string {
	var names []string
	for _, r := range m.roles {
		for _, rule := range r.Rules {
			if slices.Contains(rule.Resources, "leases") {
				names = append(names, rule.ResourceNames...)
			}
		}
	}
	return names
}
