//! The `ipwarden` binary: one executable for every role, chosen by subcommand (or by being
//! invoked as `ipwarden-cni`, the name container runtimes look plugins up by, or as
//! `kubectl-ipwarden`, the name kubectl looks its `ipwarden` plugin up by).

use anyhow::Context;
use clap::{Args, FromArgMatches, Parser, Subcommand, ValueEnum};

/// ipwarden: Kubernetes IPAM with a StatefulSet-aware IP garbage collector.
#[derive(Parser)]
#[command(name = "ipwarden", version)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, env = "IPWARDEN_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Print the CustomResourceDefinitions as YAML (what crds/ holds).
    Crd,
    /// Run the node agent that serves the CNI plugin.
    Agent(ipwarden::agent::AgentArgs),
    /// Run as the CNI plugin (the same as invoking this binary as `ipwarden-cni`).
    Cni,
    /// Run the cluster garbage-collecting controller.
    Controller(ipwarden::actors::ControllerArgs),
    #[command(flatten)]
    Operator(ipwarden::cli::Command),
}

fn main() -> anyhow::Result<()> {
    let invoked_as = std::env::args_os().next().map(std::path::PathBuf::from);
    let name = invoked_as.as_deref().and_then(|p| p.file_name());
    if name.is_some_and(|n| n == "ipwarden-cni") {
        std::process::exit(ipwarden::cni::main_from_process());
    }
    if name.is_some_and(|n| n == "kubectl-ipwarden") {
        return run_operator(kubectl_plugin_command()?);
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Crd => {
            print!("{}", ipwarden::crd::yaml().context("rendering the CRDs as YAML")?);
            Ok(())
        }
        Command::Cni => std::process::exit(ipwarden::cni::main_from_process()),
        Command::Agent(args) => {
            init_logging(cli.log_format);
            actor_system()?.block_on(ipwarden::agent::run(args))
        }
        Command::Controller(args) => {
            init_logging(cli.log_format);
            actor_system()?.block_on(ipwarden::actors::run(args))
        }
        Command::Operator(command) => run_operator(command),
    }
}

/// `kubectl ipwarden`'s command line: the operator commands only, with the connection flags
/// also accepted before the command's name (`kubectl ipwarden --context c status`), where
/// kubectl users put them; clap hands them down to the command's own flags.
fn kubectl_plugin_command() -> anyhow::Result<ipwarden::cli::Command> {
    let plugin = clap::Command::new("kubectl-ipwarden").subcommand_required(true);
    let plugin = ipwarden::cli::Command::augment_subcommands(ipwarden::cli::connect::ClusterArgs::augment_args(plugin))
        .bin_name("kubectl ipwarden")
        .version(env!("CARGO_PKG_VERSION"))
        .about("ipwarden's operator commands as a kubectl plugin: status, check, gc.");
    Ok(ipwarden::cli::Command::from_arg_matches(&plugin.get_matches())?)
}

/// Runs an operator command; exit status 1 when `check` finds a problem.
fn run_operator(command: ipwarden::cli::Command) -> anyhow::Result<()> {
    if !cli_runtime()?.block_on(command.run())? {
        std::process::exit(1);
    }
    Ok(())
}

/// A single-threaded runtime for the short-lived CLI commands.
fn cli_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread().enable_all().build().context("building the tokio runtime")
}

/// An actix system on a multi-thread tokio runtime, for the long-running roles.
fn actor_system() -> anyhow::Result<actix::SystemRunner> {
    let runtime =
        tokio::runtime::Builder::new_multi_thread().enable_all().build().context("building the tokio runtime")?;
    Ok(actix::System::with_tokio_rt(move || runtime))
}

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}
