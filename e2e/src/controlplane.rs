//! etcd, kube-apiserver, kube-controller-manager and kube-scheduler on loopback, each with
//! free ports, a log file in the run directory, and a bounded wait until it is ready.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::Client;

use crate::binaries::ControlPlaneBinaries;
use crate::error::{Error, Result};
use crate::pki::Pki;
use crate::process::{Component, free_port};
use crate::wait::{self, Probe};

/// The service-account token issuer and audience of every test cluster.
const SERVICE_ACCOUNT_ISSUER: &str = "https://kubernetes.default.svc.cluster.local";

/// A control plane's components, by name, so chaos tests can kill and restart one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ComponentName {
    /// The etcd member.
    Etcd,
    /// kube-apiserver.
    Apiserver,
    /// kube-controller-manager.
    ControllerManager,
    /// kube-scheduler.
    Scheduler,
}

impl ComponentName {
    /// The component's binary name.
    pub fn binary(self) -> &'static str {
        match self {
            Self::Etcd => "etcd",
            Self::Apiserver => "kube-apiserver",
            Self::ControllerManager => "kube-controller-manager",
            Self::Scheduler => "kube-scheduler",
        }
    }
}

/// The kube-controller-manager controllers a test cluster runs: those acting on the objects the
/// tests, the demo and the chart create (ServiceAccounts and their tokens, namespaces, owner
/// references, the workload controllers, nodes and their taints and pods, the chart's
/// PodDisruptionBudget, the type checks of its ValidatingAdmissionPolicies), and the publisher
/// of every namespace's `kube-root-ca.crt`, without which kubelet never starts a pod whose
/// service-account token is mounted (the default).
/// kube-controller-manager sets up its controllers one after the other before it starts any, so
/// with every default controller (`*`) the `default` ServiceAccount, which every test waits
/// for, came about 5 s after start-up on 2 cores; with these, half a second. A test of an
/// object no controller here acts on adds its controller.
pub const TEST_CONTROLLERS: &str = "serviceaccount-controller,serviceaccount-token-controller,namespace-controller,\
garbage-collector-controller,replicaset-controller,deployment-controller,statefulset-controller,daemonset-controller,\
job-controller,node-lifecycle-controller,taint-eviction-controller,pod-garbage-collector-controller,\
disruption-controller,validatingadmissionpolicy-status-controller,root-ca-certificate-publisher-controller";

/// Settings of the control plane that tests may want to tune.
#[derive(Clone, Debug)]
pub struct ControlPlaneOptions {
    /// kube-controller-manager's `--node-monitor-grace-period`: how long a node may miss
    /// heartbeats before it is marked NotReady (upstream default 40s; shorter in tests).
    pub node_monitor_grace_period: Duration,
    /// How long each component may take to report ready (`/readyz` of the apiserver,
    /// `/healthz` of the others) before start-up fails naming it and its log. A cold
    /// apiserver start on 2 cores installs its bootstrap RBAC policy first.
    pub ready_timeout: Duration,
    /// kube-controller-manager's `--controllers`: [`TEST_CONTROLLERS`] unless a run asks for
    /// others (the scale benchmark runs every default controller but those that need kubelets).
    pub controllers: String,
    /// An audit policy (YAML) for kube-apiserver; with it, the apiserver writes its audit
    /// log to `audit.log` in the run directory, for figures by client.
    pub audit_policy: Option<String>,
}

impl Default for ControlPlaneOptions {
    fn default() -> Self {
        Self {
            node_monitor_grace_period: Duration::from_secs(20),
            ready_timeout: Duration::from_secs(180),
            controllers: TEST_CONTROLLERS.to_string(),
            audit_policy: None,
        }
    }
}

/// The audit log's file name in the run directory when an audit policy is set.
pub const AUDIT_LOG: &str = "audit.log";

/// A running control plane.
pub struct ControlPlane {
    /// The admin kubeconfig (client certificate in group system:masters).
    pub kubeconfig: PathBuf,
    /// The apiserver's URL.
    pub server: String,
    /// The PKI files.
    pub pki: Pki,
    /// Where the binaries came from.
    pub binaries: ControlPlaneBinaries,
    components: Vec<(ComponentName, Component)>,
    client: Client,
    health_ports: [(ComponentName, u16); 2],
    ready_timeout: Duration,
}

fn ports<const N: usize>() -> Result<[u16; N]> {
    let mut ports = [0; N];
    for port in &mut ports {
        *port = free_port()?;
    }
    Ok(ports)
}

fn arg(name: &str, value: impl std::fmt::Display) -> String {
    format!("--{name}={value}")
}

impl ControlPlane {
    /// Starts every component under `dir` and waits until each reports ready. On failure
    /// the components already started are stopped and the error names the failing one and
    /// its log.
    pub async fn start(dir: &Path, binaries: ControlPlaneBinaries, options: &ControlPlaneOptions) -> Result<Self> {
        let pki = Pki::generate(&dir.join("pki"))?;
        let [etcd_client, etcd_peer, apiserver, kcm, scheduler] = ports::<5>()?;
        let server = format!("https://127.0.0.1:{apiserver}");
        let kubeconfig = dir.join("admin.kubeconfig");
        pki.write_admin_kubeconfig(&kubeconfig, &server)?;
        let log = |name: ComponentName| dir.join(format!("{}.log", name.binary()));
        let d = |sub: &str| dir.join(sub).display().to_string();
        let kc = kubeconfig.display().to_string();

        let mut components = Vec::new();
        let etcd_args = vec![
            arg("name", "e2e"),
            arg("data-dir", d("etcd")),
            arg("listen-client-urls", format!("http://127.0.0.1:{etcd_client}")),
            arg("advertise-client-urls", format!("http://127.0.0.1:{etcd_client}")),
            arg("listen-peer-urls", format!("http://127.0.0.1:{etcd_peer}")),
            arg("initial-advertise-peer-urls", format!("http://127.0.0.1:{etcd_peer}")),
            arg("initial-cluster", format!("e2e=http://127.0.0.1:{etcd_peer}")),
            arg("log-level", "warn"),
            // Test data only: durability across a machine crash is not needed, speed is.
            arg("unsafe-no-fsync", true),
        ];
        let mut apiserver_args = vec![
            arg("etcd-servers", format!("http://127.0.0.1:{etcd_client}")),
            arg("bind-address", "127.0.0.1"),
            arg("advertise-address", "127.0.0.1"),
            arg("secure-port", apiserver),
            arg("tls-cert-file", pki.serving_cert.display()),
            arg("tls-private-key-file", pki.serving_key.display()),
            arg("client-ca-file", pki.ca_cert.display()),
            arg("service-account-issuer", SERVICE_ACCOUNT_ISSUER),
            arg("service-account-key-file", pki.sa_pub.display()),
            arg("service-account-signing-key-file", pki.sa_key.display()),
            arg("service-cluster-ip-range", "10.96.0.0/16"),
            arg("authorization-mode", "RBAC"),
            arg("allow-privileged", true),
            // The `kubernetes` Service cannot point at a loopback address; nothing here uses it.
            arg("endpoint-reconciler-type", "none"),
            arg("profiling", false),
        ];
        if let Some(policy) = &options.audit_policy {
            let file = dir.join("audit-policy.yaml");
            std::fs::write(&file, policy).map_err(Error::io("writing the audit policy", &file))?;
            apiserver_args.push(arg("audit-policy-file", file.display()));
            apiserver_args.push(arg("audit-log-path", dir.join(AUDIT_LOG).display()));
        }
        let kcm_args = vec![
            arg("kubeconfig", &kc),
            arg("authentication-kubeconfig", &kc),
            arg("authorization-kubeconfig", &kc),
            arg("bind-address", "127.0.0.1"),
            arg("secure-port", kcm),
            arg("cert-dir", d("kube-controller-manager")),
            arg("leader-elect", false),
            arg("controllers", &options.controllers),
            arg("use-service-account-credentials", true),
            arg("service-account-private-key-file", pki.sa_key.display()),
            arg("root-ca-file", pki.ca_cert.display()),
            arg("cluster-signing-cert-file", pki.ca_cert.display()),
            arg("cluster-signing-key-file", pki.ca_key.display()),
            arg("node-monitor-period", "2s"),
            arg("node-monitor-grace-period", format!("{}s", options.node_monitor_grace_period.as_secs())),
            arg("profiling", false),
        ];
        let scheduler_args = vec![
            arg("kubeconfig", &kc),
            arg("authentication-kubeconfig", &kc),
            arg("authorization-kubeconfig", &kc),
            arg("bind-address", "127.0.0.1"),
            arg("secure-port", scheduler),
            arg("cert-dir", d("kube-scheduler")),
            arg("leader-elect", false),
            arg("profiling", false),
        ];

        for (name, args) in [(ComponentName::Etcd, etcd_args), (ComponentName::Apiserver, apiserver_args)] {
            components.push((name, Component::start(name.binary(), &binaries.path(name.binary()), args, log(name))?));
        }
        let client = client_for(&kubeconfig).await?;
        let mut plane = Self {
            kubeconfig,
            server,
            pki,
            binaries,
            components,
            client,
            health_ports: [(ComponentName::ControllerManager, kcm), (ComponentName::Scheduler, scheduler)],
            ready_timeout: options.ready_timeout,
        };
        plane.wait_apiserver_ready().await?;
        for (name, args) in [(ComponentName::ControllerManager, kcm_args), (ComponentName::Scheduler, scheduler_args)] {
            let component = Component::start(name.binary(), &plane.binaries.path(name.binary()), args, log(name))?;
            plane.components.push((name, component));
        }
        for (name, port) in plane.health_ports {
            plane.wait_healthz(name, port).await?;
        }
        Ok(plane)
    }

    /// A client with the admin identity.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The log file of every component, for failure messages.
    pub fn logs(&self) -> Vec<&Path> {
        self.components.iter().map(|(_, c)| c.log()).collect()
    }

    /// The process ID of a running component, for its CPU and memory figures.
    pub fn pid(&self, name: ComponentName) -> Option<u32> {
        self.components.iter().find(|(n, _)| *n == name).and_then(|(_, c)| c.pid())
    }

    /// Fails when any component has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        self.components.iter_mut().try_for_each(|(_, c)| c.ensure_running())
    }

    fn component(&mut self, name: ComponentName) -> Result<&mut Component> {
        self.components.iter_mut().find(|(n, _)| *n == name).map(|(_, c)| c).ok_or_else(|| Error::Exited {
            component: name.binary().to_string(),
            status: "never started".to_string(),
            log: PathBuf::new(),
        })
    }

    /// Kills a component with SIGKILL (a crash), for chaos tests.
    pub fn kill(&mut self, name: ComponentName) -> Result<()> {
        self.component(name)?.kill();
        Ok(())
    }

    /// Freezes a component with SIGSTOP (it hangs: its clients' calls get no answer).
    pub fn pause(&mut self, name: ComponentName) -> Result<()> {
        self.component(name)?.pause();
        Ok(())
    }

    /// Lets a component frozen by [`ControlPlane::pause`] run again.
    pub fn resume(&mut self, name: ComponentName) -> Result<()> {
        self.component(name)?.resume();
        Ok(())
    }

    /// Starts a killed or stopped component again and waits until it is ready.
    pub async fn restart(&mut self, name: ComponentName) -> Result<()> {
        self.component(name)?.restart()?;
        match name {
            ComponentName::Etcd | ComponentName::Apiserver => self.wait_apiserver_ready().await,
            ComponentName::ControllerManager | ComponentName::Scheduler => {
                let port = self.health_ports.iter().find(|(n, _)| *n == name).map(|(_, p)| *p).unwrap_or_default();
                self.wait_healthz(name, port).await
            }
        }
    }

    /// Kills every component at once (SIGKILL): the end of a run whose logs nobody reads.
    pub fn kill_all(&mut self) {
        for (_, component) in self.components.iter_mut().rev() {
            component.kill();
        }
    }

    /// Stops every component, newest first (scheduler and controller manager before the
    /// apiserver, etcd last).
    pub fn stop(&mut self) {
        for (_, component) in self.components.iter_mut().rev() {
            component.stop();
        }
    }

    async fn wait_apiserver_ready(&mut self) -> Result<()> {
        let client = self.client.clone();
        let log = self.component(ComponentName::Apiserver)?.log().to_path_buf();
        let (components, timeout) = (&mut self.components, self.ready_timeout);
        let result = wait::until("kube-apiserver /readyz", timeout, || {
            let running = components.iter_mut().try_for_each(|(_, c)| c.ensure_running());
            let client = client.clone();
            async move {
                running?;
                Ok(match wait::quietly(client.request_text(get("/readyz"))).await {
                    Ok(body) if body.trim() == "ok" => Probe::Done(()),
                    Ok(body) => Probe::Pending(body),
                    Err(e) => Probe::Pending(e.to_string()),
                })
            }
        })
        .await;
        not_ready_names_log(result, ComponentName::Apiserver, timeout, log)
    }

    async fn wait_healthz(&mut self, name: ComponentName, port: u16) -> Result<()> {
        let mut config = kube::Config::new(local_uri(port)?);
        config.accept_invalid_certs = true;
        // Quiet: the client warns that it skips certificate checks, which a probe of a
        // component's self-signed /healthz means to do.
        let client = tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::default(), || {
            Client::try_from(config)
        })
        .map_err(Error::kube(format!("building a /healthz client for {}", name.binary())))?;
        let log = self.component(name)?.log().to_path_buf();
        let (components, timeout) = (&mut self.components, self.ready_timeout);
        let what = format!("{} /healthz", name.binary());
        let result = wait::until(&what, timeout, || {
            let running = components.iter_mut().try_for_each(|(_, c)| c.ensure_running());
            let client = client.clone();
            async move {
                running?;
                Ok(match wait::quietly(client.request_text(get("/healthz"))).await {
                    Ok(body) if body.trim() == "ok" => Probe::Done(()),
                    Ok(body) => Probe::Pending(body),
                    Err(e) => Probe::Pending(e.to_string()),
                })
            }
        })
        .await;
        not_ready_names_log(result, name, timeout, log)
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

fn get(path: &'static str) -> http::Request<Vec<u8>> {
    let mut request = http::Request::new(Vec::new());
    *request.uri_mut() = http::Uri::from_static(path);
    request
}

fn local_uri(port: u16) -> Result<http::Uri> {
    let text = format!("https://127.0.0.1:{port}");
    text.parse()
        .map_err(|e: http::uri::InvalidUri| Error::Kubeconfig { path: PathBuf::from(&text), reason: e.to_string() })
}

/// Turns a timeout into [`Error::NotReady`] naming the component and its log.
fn not_ready_names_log(result: Result<()>, name: ComponentName, timeout: Duration, log: PathBuf) -> Result<()> {
    match result {
        Err(Error::Timeout { last, .. }) => {
            Err(Error::NotReady { component: name.binary().to_string(), timeout, last, log })
        }
        other => other,
    }
}

/// A client from a kubeconfig file.
pub async fn client_for(kubeconfig: &Path) -> Result<Client> {
    let fail = |reason: String| Error::Kubeconfig { path: kubeconfig.to_path_buf(), reason };
    let file = kube::config::Kubeconfig::read_from(kubeconfig).map_err(|e| fail(e.to_string()))?;
    let config = kube::Config::from_custom_kubeconfig(file, &kube::config::KubeConfigOptions::default())
        .await
        .map_err(|e| fail(e.to_string()))?;
    Client::try_from(config).map_err(|e| fail(e.to_string()))
}
