//! Holding a real node's CNI ADDs after ipwarden returned: the chart's chain is `ptp` (with
//! `ipwarden-cni` as its IPAM) then `portmap`, and the hold swaps the node's `portmap` for a
//! script that waits, on ADD only, while the hold lives, then runs the real one. The runtime
//! makes a sandbox only once the whole chain returned, so meanwhile the agent has recorded the
//! sandbox's IP and the runtime does not list the sandbox: what a slow plugin later in a chain
//! (or a Multus delegate) does.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The plugin the hold stands in for.
const HELD_PLUGIN: &str = "portmap";

/// A hold on the ADDs of one node's CNI chain; dropping it lets them go on and puts the real
/// plugin back.
#[derive(Debug)]
pub struct ChainHold {
    plugin: PathBuf,
    real: PathBuf,
    file: PathBuf,
}

impl ChainHold {
    /// Holds the ADDs of the chain whose plugins are in `bin_dir`, with the hold's files in
    /// `dir`.
    pub fn start(bin_dir: &Path, dir: &Path) -> Result<Self> {
        let plugin = bin_dir.join(HELD_PLUGIN);
        let real = std::fs::read_link(&plugin).map_err(Error::io("reading the plugin's link", &plugin))?;
        let file = dir.join("chain-hold");
        let _stale = std::fs::remove_file(file.with_extension("waiting"));
        std::fs::write(&file, b"").map_err(Error::io("making the chain hold", &file))?;
        let script = format!(
            "#!/bin/sh\n# e2e: an ADD of the chain waits here while {hold} exists\nif [ \"$CNI_COMMAND\" = ADD ]; then\n  while [ -e '{hold}' ]; do : > '{waiting}'; sleep 0.1; done\nfi\nexec '{real}' \"$@\"\n",
            hold = file.display(),
            waiting = file.with_extension("waiting").display(),
            real = real.display(),
        );
        let held = Self { plugin: plugin.clone(), real, file };
        let staged = plugin.with_extension("held");
        std::fs::write(&staged, script).map_err(Error::io("writing the held plugin", &staged))?;
        std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(0o755))
            .map_err(Error::io("making the held plugin executable", &staged))?;
        std::fs::rename(&staged, &plugin).map_err(Error::io("putting the held plugin in place", &plugin))?;
        Ok(held)
    }

    /// Whether an ADD waits on the hold.
    pub fn holds_an_add(&self) -> bool {
        self.file.with_extension("waiting").exists()
    }
}

impl Drop for ChainHold {
    fn drop(&mut self) {
        let _gone = std::fs::remove_file(&self.file);
        let staged = self.plugin.with_extension("real");
        let _linked =
            std::os::unix::fs::symlink(&self.real, &staged).and_then(|()| std::fs::rename(&staged, &self.plugin));
        let _waiting = std::fs::remove_file(self.file.with_extension("waiting"));
    }
}
