//! The cluster's PKI: a CA, the apiserver's serving certificate, an admin client
//! certificate (group system:masters) and the service-account signing key, written as PEM
//! files into the run directory, plus the admin kubeconfig that uses them.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
    SanType,
};

use crate::error::{Error, Result};

/// The first address of the service range the apiserver is given: the `kubernetes`
/// Service's ClusterIP, which the serving certificate must name.
pub const KUBERNETES_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);

/// Paths of the PEM files one cluster uses.
#[derive(Clone, Debug)]
pub struct Pki {
    /// CA certificate: trusted for serving and client certificates.
    pub ca_cert: PathBuf,
    /// CA key: kube-controller-manager signs CSRs with it.
    pub ca_key: PathBuf,
    /// kube-apiserver serving certificate.
    pub serving_cert: PathBuf,
    /// kube-apiserver serving key.
    pub serving_key: PathBuf,
    /// Admin client certificate (O=system:masters).
    pub admin_cert: PathBuf,
    /// Admin client key.
    pub admin_key: PathBuf,
    /// Service-account token signing key (private).
    pub sa_key: PathBuf,
    /// Service-account token verification key (public).
    pub sa_pub: PathBuf,
}

fn pki_err(what: &str) -> impl FnOnce(rcgen::Error) -> Error + '_ {
    move |source| Error::Pki { what: what.to_string(), source }
}

fn write(path: &Path, contents: &str) -> Result<()> {
    std::fs::write(path, contents).map_err(Error::io("writing PEM file", path))
}

impl Pki {
    /// Generates fresh keys and certificates into `dir`.
    pub fn generate(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).map_err(Error::io("creating PKI directory", dir))?;
        let pki = Self {
            ca_cert: dir.join("ca.crt"),
            ca_key: dir.join("ca.key"),
            serving_cert: dir.join("apiserver.crt"),
            serving_key: dir.join("apiserver.key"),
            admin_cert: dir.join("admin.crt"),
            admin_key: dir.join("admin.key"),
            sa_key: dir.join("sa.key"),
            sa_pub: dir.join("sa.pub"),
        };

        let ca_key = KeyPair::generate().map_err(pki_err("CA key"))?;
        let mut ca_params = CertificateParams::default();
        ca_params.distinguished_name.push(DnType::CommonName, "ipwarden-e2e-ca");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let ca_cert = ca_params.self_signed(&ca_key).map_err(pki_err("CA certificate"))?;
        write(&pki.ca_cert, &ca_cert.pem())?;
        write(&pki.ca_key, &ca_key.serialize_pem())?;
        let issuer = Issuer::new(ca_params, ca_key);

        let serving_key = KeyPair::generate().map_err(pki_err("apiserver serving key"))?;
        let mut serving = CertificateParams::new(vec![
            "localhost".to_string(),
            "kubernetes".to_string(),
            "kubernetes.default".to_string(),
            "kubernetes.default.svc".to_string(),
            "kubernetes.default.svc.cluster.local".to_string(),
        ])
        .map_err(pki_err("apiserver serving certificate names"))?;
        serving.subject_alt_names.push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        serving.subject_alt_names.push(SanType::IpAddress(IpAddr::V4(KUBERNETES_SERVICE_IP)));
        serving.distinguished_name.push(DnType::CommonName, "kube-apiserver");
        serving.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_cert =
            serving.signed_by(&serving_key, &issuer).map_err(pki_err("apiserver serving certificate"))?;
        write(&pki.serving_cert, &serving_cert.pem())?;
        write(&pki.serving_key, &serving_key.serialize_pem())?;

        let admin_key = KeyPair::generate().map_err(pki_err("admin client key"))?;
        let mut admin = CertificateParams::default();
        admin.distinguished_name.push(DnType::CommonName, "ipwarden-e2e-admin");
        admin.distinguished_name.push(DnType::OrganizationName, "system:masters");
        admin.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let admin_cert = admin.signed_by(&admin_key, &issuer).map_err(pki_err("admin client certificate"))?;
        write(&pki.admin_cert, &admin_cert.pem())?;
        write(&pki.admin_key, &admin_key.serialize_pem())?;

        let sa_key = KeyPair::generate().map_err(pki_err("service-account signing key"))?;
        write(&pki.sa_key, &sa_key.serialize_pem())?;
        write(&pki.sa_pub, &sa_key.public_key_pem())?;
        Ok(pki)
    }

    /// Writes a kubeconfig for the admin user pointing at `server`.
    pub fn write_admin_kubeconfig(&self, path: &Path, server: &str) -> Result<()> {
        let user = serde_json::json!({"client-certificate": self.admin_cert, "client-key": self.admin_key});
        self.write_kubeconfig(path, server, "admin", user)
    }

    /// Writes a kubeconfig for `server` (trusting this CA) whose user `name` authenticates
    /// with the kubeconfig `user` fields (a client certificate, a token, ...).
    pub fn write_kubeconfig(&self, path: &Path, server: &str, name: &str, user: serde_json::Value) -> Result<()> {
        let kubeconfig = serde_json::json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "ipwarden-e2e", "cluster": {
                "server": server,
                "certificate-authority": self.ca_cert,
            }}],
            "users": [{"name": name, "user": user}],
            "contexts": [{"name": "ipwarden-e2e", "context": {"cluster": "ipwarden-e2e", "user": name}}],
            "current-context": "ipwarden-e2e",
        });
        let text = serde_json::to_string_pretty(&kubeconfig).map_err(|e| Error::Io {
            what: "serializing kubeconfig".to_string(),
            path: path.to_path_buf(),
            source: e.into(),
        })?;
        std::fs::write(path, text).map_err(Error::io("writing kubeconfig", path))
    }
}
