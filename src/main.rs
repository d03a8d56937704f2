//! The `ipwarden` binary: one executable for every role, chosen by subcommand (or by being
//! invoked as `ipwarden-cni`, the name container runtimes look plugins up by).

use anyhow::Context;
use clap::{Parser, Subcommand};

/// ipwarden: Kubernetes IPAM with a StatefulSet-aware IP garbage collector.
#[derive(Parser)]
#[command(name = "ipwarden", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the CustomResourceDefinitions as YAML (what crds/ holds).
    Crd,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Crd => {
            print!("{}", ipwarden::crd::yaml().context("rendering the CRDs as YAML")?);
            Ok(())
        }
    }
}
