//! Leader election on the real control plane, where clocks and apiservers misbehave: a
//! standby whose clock runs ahead never takes a live lease, and a leader whose apiserver
//! hangs steps down within its renew deadline; neither writes while it does not lead.

mod support;

use std::time::Duration;

use e2e::controlplane::ComponentName;
use e2e::wait::{self, Probe};
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::Api;
use serde_json::json;
use support::{Ipwarden, TIMEOUT, metric};

/// The Lease duration the support module starts controllers with.
const LEASE_SECONDS: u64 = 4;

fn pool() -> [(&'static str, serde_json::Value); 1] {
    [("pool", json!({"cidr": "10.63.0.0/24", "default": true}))]
}

/// The Lease's holder, renew time and field managers (one per replica that wrote it).
async fn lease(client: &kube::Client) -> (String, String, Vec<String>) {
    let lease = Api::<Lease>::namespaced(client.clone(), "default").get("ipwarden-controller").await.expect("lease");
    let managers = lease.metadata.managed_fields.iter().flatten().filter_map(|f| f.manager.clone()).collect();
    let spec = lease.spec.unwrap_or_default();
    let renewed = spec.renew_time.map(|t| t.0.to_string()).unwrap_or_default();
    (spec.holder_identity.unwrap_or_default(), renewed, managers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_whose_clock_runs_ahead_never_takes_a_live_lease() {
    let mut ipwarden = Ipwarden::start(1, &pool(), &[]).await;
    let client = ipwarden.client();
    ipwarden.start_controller("steady", &[]);
    ipwarden.wait_leader(0).await;
    ipwarden.start_controller("ahead", &["--test-clock-offset-seconds=60"]);

    // Over ten renewals of the live leader, the standby a minute ahead never leads.
    let seen = std::sync::Mutex::new((0u32, lease(&client).await.1));
    wait::until("ten renewals by the leader", TIMEOUT, || async {
        let (holder, renewed, managers) = lease(&client).await;
        assert_eq!(holder, "steady", "the live leader keeps the lease");
        assert!(!managers.iter().any(|m| m.ends_with("-ahead")), "the standby never wrote the lease: {managers:?}");
        let ahead = ipwarden.scrape_controller(1).await.unwrap_or_default();
        assert_eq!(metric(&ahead, "ipwarden_controller_leader"), 0.0, "the skewed standby does not lead");
        let mut seen = seen.lock().expect("lock");
        if renewed != seen.1 {
            *seen = (seen.0 + 1, renewed);
        }
        Ok(if seen.0 >= 10 { Probe::Done(()) } else { Probe::Pending(format!("{} renewals", seen.0)) })
    })
    .await
    .expect("the leader renews");

    // Once the leader is gone, the standby takes over by its own observation, clock or not.
    ipwarden.controllers[0].kill();
    ipwarden.wait_leader(1).await;
    assert_eq!(lease(&client).await.0, "ahead");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_apiserver_hangs_steps_down_within_its_renew_deadline() {
    let mut ipwarden = Ipwarden::start(1, &pool(), &[]).await;
    ipwarden.start_controller("first", &[]);
    ipwarden.wait_leader(0).await;
    ipwarden.start_controller("second", &[]);

    ipwarden.cluster.control_plane().pause(ComponentName::Apiserver).expect("SIGSTOP the apiserver");
    let paused = std::time::Instant::now();
    // The bound: the renew deadline (2/3 of the lease) plus a renew interval and slack; an
    // unbounded Lease call would keep "leading" until the client's read timeout (minutes).
    let bound = Duration::from_secs(LEASE_SECONDS * 3);
    let stepped_down = wait::until("the leader stepping down while the apiserver hangs", bound, || async {
        let text = ipwarden.scrape_controller(0).await.unwrap_or_default();
        Ok(if metric(&text, "ipwarden_controller_leader") == 0.0 {
            Probe::Done(())
        } else {
            Probe::Pending("still leading".into())
        })
    })
    .await;
    let waited = paused.elapsed();
    ipwarden.cluster.control_plane().resume(ComponentName::Apiserver).expect("SIGCONT the apiserver");
    stepped_down.unwrap_or_else(|e| panic!("{e} (after {waited:?})"));
    println!("the leader stepped down {waited:?} after the apiserver froze");
    let second = ipwarden.scrape_controller(1).await.unwrap_or_default();
    assert_eq!(metric(&second, "ipwarden_controller_leader"), 0.0, "the standby could not acquire either");

    // Afterwards exactly one replica leads, and it is the one the Lease names.
    let leader = ipwarden.wait_any_leader().await;
    let client = ipwarden.client();
    let holder = lease(&client).await.0;
    assert_eq!(holder, ["first", "second"][leader], "the leading replica holds the lease");
    let other = ipwarden.scrape_controller(1 - leader).await.unwrap_or_default();
    assert_eq!(metric(&other, "ipwarden_controller_leader"), 0.0, "one leader only");
}
