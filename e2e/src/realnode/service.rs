//! The cluster's `kubernetes` Service for the pods of the real nodes, as kube-proxy would give
//! it to them: a pod using its in-cluster configuration (the chart's agent and controllers)
//! dials `KUBERNETES_SERVICE_HOST:443`, the Service's ClusterIP
//! ([`crate::pki::KUBERNETES_SERVICE_IP`], in the apiserver's certificate), which the test
//! cluster has no kube-proxy to route. A DNAT rule (in `nat`'s `PREROUTING` for pods on the pod
//! network and `OUTPUT` for hostNetwork pods, as kube-proxy's `KUBE-SERVICES`) sends it to
//! [`SERVICE_ADDRESS`], an address on the host's loopback interface, where a forwarder hands
//! each connection to the apiserver on 127.0.0.1. The apiserver stays on loopback; a pod cannot
//! reach 127.0.0.1 of the host (kubelet's `KUBE-FIREWALL` drops it), hence the forwarder. The
//! host guard removes the chain (its name has kubelet's `KUBE-` prefix) and the address.

use std::net::{Ipv4Addr, SocketAddr};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use super::host::{HostGuard, command_output};
use crate::error::{Error, Result};

/// Where the Service's connections go on the host: an address of the loopback interface
/// (TEST-NET-1, beside the real nodes' own).
pub const SERVICE_ADDRESS: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);

/// The `nat` chain holding the Service's rule.
const CHAIN: &str = "KUBE-E2E-APISERVER";

/// The Service while it lives: the forwarder stops when dropped.
#[derive(Debug)]
pub struct KubernetesService {
    forwarder: JoinHandle<()>,
}

impl Drop for KubernetesService {
    fn drop(&mut self) {
        self.forwarder.abort();
    }
}

impl KubernetesService {
    /// Routes the Service to the apiserver at 127.0.0.1:`apiserver_port`; call it inside the
    /// tokio runtime the forwarder is to run on.
    pub(super) fn start(host: &mut HostGuard, apiserver_port: u16) -> Result<Self> {
        host.add_node_ip(&SERVICE_ADDRESS.to_string())?;
        let listen = SocketAddr::from((SERVICE_ADDRESS, apiserver_port));
        let listening = Error::io("listening for the kubernetes Service", listen.to_string());
        let listener = std::net::TcpListener::bind(listen)
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .and_then(TcpListener::from_std)
            .map_err(listening)?;
        let service = crate::pki::KUBERNETES_SERVICE_IP.to_string();
        let target = format!("{SERVICE_ADDRESS}:{apiserver_port}");
        command_output("iptables", &["-t", "nat", "-N", CHAIN])?;
        command_output(
            "iptables",
            &[
                "-t",
                "nat",
                "-A",
                CHAIN,
                "-d",
                &service,
                "-p",
                "tcp",
                "--dport",
                "443",
                "-j",
                "DNAT",
                "--to-destination",
                &target,
            ],
        )?;
        for hook in ["PREROUTING", "OUTPUT"] {
            command_output("iptables", &["-t", "nat", "-I", hook, "-j", CHAIN])?;
        }
        let forwarder = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                tokio::spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect((Ipv4Addr::LOCALHOST, apiserver_port)).await {
                        let _closed = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Ok(Self { forwarder })
    }
}
