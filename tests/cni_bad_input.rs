//! Bad input at the real `ipwarden-cni` binary, with a real agent behind it: input that can
//! never succeed gets a permanent CNI error naming the limit (never "try again later", which
//! makes a runtime retry it forever), and the plugin never reads more stdin than its limit.

mod support;

use std::io::{ErrorKind, Read, Write};
use std::process::{Command, Stdio};

use e2e::cni::{Invocation, PodArgs};
use k8s_openapi::api::core::v1::Pod;
use kube::ResourceExt;
use kube::api::Api;
use serde_json::{Value, json};
use support::Ipwarden;

/// What the plugin may read from stdin, and the agent from one request (docs/data-model.md,
/// "Input limits").
const STDIN_LIMIT: usize = 1024 * 1024;

fn netconf(socket: &std::path::Path, name: &str) -> Value {
    json!({"cniVersion": "1.1.0", "name": name, "type": "ipwarden-cni", "socket": socket})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_or_invalid_input_gets_a_permanent_error_naming_the_limit() {
    let ipwarden = Ipwarden::start(1, &[("pool", json!({"cidr": "10.62.0.0/24", "default": true}))], &[]).await;
    let network = support::network();
    let socket = e2e::ipwarden::agent_socket(&ipwarden.cluster, 0);
    let client = ipwarden.client();
    // A pod bound to a node no kubelet runs, so only this test wires it.
    support::create_pod(&client, "default", "manual", "elsewhere", json!({"app": "manual"})).await;
    let pod = Api::<Pod>::namespaced(client.clone(), "default").get("manual").await.expect("pod");
    let args = PodArgs { namespace: "default".into(), name: "manual".into(), uid: pod.uid().unwrap_or_default() };
    let add = |conf: Value| {
        let (network, args) = (network.clone(), args.clone());
        async move {
            let call =
                Invocation { command: "ADD", container_id: "c0ffee", ifname: "eth0", pod: Some(&args), netconf: &conf };
            network.invoke(&call).await
        }
    };

    // 8 MiB of valid name characters: over the stdin limit.
    let huge = add(netconf(&socket, &"a".repeat(8 * 1024 * 1024))).await.expect_err("an 8 MiB netconf is refused");
    let huge = huge.to_string();
    assert!(huge.contains("code 7"), "invalid network config, not try-again-later: {huge}");
    assert!(huge.contains(&STDIN_LIMIT.to_string()), "the error names the limit: {huge}");

    // Under the stdin limit, but a network name no record should carry.
    let long = add(netconf(&socket, &"n".repeat(300))).await.expect_err("a 300-byte network name is refused");
    let long = long.to_string();
    assert!(long.contains("code 7") && long.contains("253"), "the name limit is named: {long}");

    // The agent is still healthy and serves a good call.
    let good = add(netconf(&socket, "ipwarden")).await.expect("a good ADD still works").expect("a result");
    assert!(good["ips"][0]["address"].as_str().is_some_and(|a| a.starts_with("10.62.0.")), "{good}");

    // A client that is not the plugin sends the agent a line over its limit: a permanent
    // error naming the limit, and the agent reads no more than that.
    let mut raw = std::os::unix::net::UnixStream::connect(&socket).expect("connect to the agent");
    raw.write_all(&vec![b'a'; STDIN_LIMIT + 1]).expect("write one byte over the limit");
    raw.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let mut answer = String::new();
    raw.read_to_string(&mut answer).expect("the agent answers");
    let answer: Value = serde_json::from_str(&answer).expect("a JSON answer");
    assert_eq!(answer["error"]["code"], 7, "{answer}");
    assert!(answer["error"]["msg"].as_str().is_some_and(|m| m.contains(&STDIN_LIMIT.to_string())), "{answer}");

    // 64 MiB of garbage: the plugin answers after reading at most its limit and leaves the rest
    // unread (a real runtime's writer sees a closed pipe and ignores it, as Go's os/exec does).
    let plugin = network.plugin_dirs[0].join("ipwarden-cni");
    let mut child = Command::new(&plugin)
        .env_clear()
        .env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", "garbage")
        .env("CNI_NETNS", "/var/run/netns/garbage")
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", &network.plugin_dirs[0])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the plugin starts");
    let mut stdin = child.stdin.take().expect("stdin");
    let writer = std::thread::spawn(move || {
        let chunk = vec![b'{'; 64 * 1024];
        let mut accepted = 0usize;
        while accepted < 64 * 1024 * 1024 {
            match stdin.write(&chunk) {
                Ok(n) => accepted += n,
                Err(e) if e.kind() == ErrorKind::BrokenPipe => break,
                Err(e) => panic!("writing to the plugin: {e}"),
            }
        }
        accepted
    });
    let mut stdout = String::new();
    child.stdout.take().expect("stdout").read_to_string(&mut stdout).expect("read stdout");
    let status = child.wait().expect("the plugin exits");
    let accepted = writer.join().expect("writer");
    assert!(!status.success(), "garbage fails");
    let error: Value = serde_json::from_str(&stdout).expect("a CNI error object");
    assert_eq!(error["code"], 7, "{error}");
    assert!(error["msg"].as_str().is_some_and(|m| m.contains(&STDIN_LIMIT.to_string())), "{error}");
    assert!(accepted < 8 * 1024 * 1024, "the plugin stopped reading near its limit, not after {accepted} bytes");
}
