//! Where the GPUs sit on the PCIe tree, and which of them form islands.
//!
//! Two sources describe a host: the link matrix printed by `nvidia-smi topo -m` and the sysfs
//! paths of the GPUs (`readlink -f /sys/bus/pci/devices/<bdf>`). Both are parsed into one
//! [`Topology`]: a symmetric matrix of [`LinkKind`] between GPUs. Islands are the connected
//! groups under "no worse than" a link kind: [`IslandLevel::Switch`] joins GPUs behind one PCIe
//! switch (PIX/PXB), [`IslandLevel::Socket`] joins GPUs that reach each other without crossing
//! the CPU interconnect (anything but SYS). The island-hierarchical all-reduce keeps the slow
//! links between islands down to one exchange of 1/island_size of the message per rank.

use std::fmt;
use std::str::FromStr;

/// How two GPUs reach each other over PCIe, ordered from nearest to farthest.
///
/// The names and meanings are those of `nvidia-smi topo -m`'s legend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LinkKind {
    /// The GPU itself (`X`).
    SelfLink,
    /// Bonded NVLinks (`NV#`); never present on the target hosts, parsed so a matrix with them
    /// is still understood.
    NvLink(u8),
    /// At most a single PCIe bridge: two GPUs behind one switch.
    Pix,
    /// Several PCIe bridges without the host bridge: a tree of switches.
    Pxb,
    /// Through a PCIe host bridge (the CPU root complex), same root complex.
    Phb,
    /// Between host bridges within one NUMA node (one socket, several root complexes).
    Node,
    /// Across the SMP interconnect between sockets (UPI / Infinity Fabric).
    Sys,
}

impl LinkKind {
    /// The code `nvidia-smi` prints.
    pub fn code(self) -> String {
        match self {
            LinkKind::SelfLink => "X".into(),
            LinkKind::NvLink(n) => format!("NV{n}"),
            LinkKind::Pix => "PIX".into(),
            LinkKind::Pxb => "PXB".into(),
            LinkKind::Phb => "PHB".into(),
            LinkKind::Node => "NODE".into(),
            LinkKind::Sys => "SYS".into(),
        }
    }

    /// True when traffic between the two GPUs passes a CPU root complex. Posted writes that do
    /// this can collapse (52 → 6 GB/s measured) while reads do not, which is why push versus
    /// pull is a per-host choice.
    pub fn crosses_root_complex(self) -> bool {
        matches!(self, LinkKind::Phb | LinkKind::Node | LinkKind::Sys)
    }

    /// One-way P2P latency of the path relative to one switch hop (~0.4 µs measured between GPUs
    /// behind one switch). Used by the cost model; each root complex or socket crossing adds a
    /// fraction of a hop, not a whole one, because the measured one-switch figure already
    /// includes both GPUs' link and DMA latency.
    pub fn latency_factor(self) -> f64 {
        match self {
            LinkKind::SelfLink => 0.0,
            LinkKind::NvLink(_) | LinkKind::Pix => 1.0,
            LinkKind::Pxb => 1.25,
            LinkKind::Phb => 1.5,
            LinkKind::Node => 1.75,
            LinkKind::Sys => 2.0,
        }
    }
}

impl FromStr for LinkKind {
    type Err = TopologyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s {
            "X" => LinkKind::SelfLink,
            "PIX" => LinkKind::Pix,
            "PXB" => LinkKind::Pxb,
            "PHB" => LinkKind::Phb,
            "NODE" => LinkKind::Node,
            "SYS" => LinkKind::Sys,
            other => match other.strip_prefix("NV").map(str::parse::<u8>) {
                Some(Ok(n)) => LinkKind::NvLink(n),
                _ => return Err(TopologyError::UnknownLink(other.to_string())),
            },
        })
    }
}

impl fmt::Display for LinkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.code())
    }
}

/// Which link kinds join GPUs into one island.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IslandLevel {
    /// Behind one PCIe switch tree (PIX or PXB): full switch bandwidth, no root complex.
    Switch,
    /// Within one socket (anything but SYS).
    Socket,
}

impl IslandLevel {
    fn joins(self, link: LinkKind) -> bool {
        match self {
            IslandLevel::Switch => link <= LinkKind::Pxb,
            IslandLevel::Socket => link <= LinkKind::Node,
        }
    }
}

/// Peer-to-peer support between two GPUs, as `nvidia-smi topo -p2p r|w|a` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct P2pCapability {
    pub read: bool,
    pub write: bool,
    /// Peer atomics. Always false over PCIe on the target hosts, which is why the flag protocol
    /// uses only atomic stores and loads on peer memory, never read-modify-write.
    pub atomics: bool,
}

/// One GPU as the topology sources describe it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GpuPlacement {
    /// CUDA-visible index (`GPU3` → 3).
    pub index: usize,
    /// NUMA node of the GPU's root complex, when known.
    pub numa_node: Option<u32>,
    /// Root complex (`pci0000:40`), when parsed from sysfs.
    pub root_complex: Option<String>,
    /// Bridges from the root port down to (excluding) the GPU, when parsed from sysfs.
    pub bridges: Vec<String>,
    /// The GPU's own bus/device/function, when parsed from sysfs.
    pub bus_id: Option<String>,
}

/// A host's GPUs and the links between them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub gpus: Vec<GpuPlacement>,
    /// `links[a][b]`, symmetric, `SelfLink` on the diagonal.
    pub links: Vec<Vec<LinkKind>>,
    /// `p2p[a][b]`, when a `-p2p` matrix was merged in.
    pub p2p: Option<Vec<Vec<P2pCapability>>>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TopologyError {
    #[error("unknown link kind {0:?} in topology matrix")]
    UnknownLink(String),
    #[error("topology matrix has no GPU header line (expected a line starting with GPU0)")]
    NoHeader,
    #[error("topology row for {row} has {found} link columns, expected {expected}")]
    ShortRow {
        row: String,
        found: usize,
        expected: usize,
    },
    #[error("GPU rows are not GPU0..GPU{expected_last} in order (found {found})")]
    RowOrder { expected_last: usize, found: String },
    #[error("topology matrix is not symmetric: GPU{a}->GPU{b} is {ab} but GPU{b}->GPU{a} is {ba}")]
    Asymmetric {
        a: usize,
        b: usize,
        ab: LinkKind,
        ba: LinkKind,
    },
    #[error("diagonal entry for GPU{0} is not X")]
    Diagonal(usize),
    #[error("sysfs path {0:?} does not start at a /sys/devices/pciDDDD:BB root complex")]
    BadSysfsPath(String),
    #[error("unknown p2p status {0:?} (expected OK, NS, CNS, GNS, TNS, NS or U)")]
    UnknownP2p(String),
    #[error("p2p matrix has {found} GPUs, topology has {expected}")]
    P2pSize { found: usize, expected: usize },
    #[error("no GPUs found")]
    Empty,
}

/// Removes ANSI escape sequences: `nvidia-smi` underlines the header when writing to a terminal,
/// and captured output often keeps the codes.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Parses the GPU block of a device matrix (`topo -m` or `topo -p2p`): the header row naming the
/// columns and one row per GPU. Returns the column count of GPUs and the GPU rows' tokens after
/// the row name. NIC rows and the legend are skipped.
fn matrix_rows(text: &str) -> Result<(usize, Vec<Vec<String>>), TopologyError> {
    let mut gpu_columns = None;
    let mut rows: Vec<Vec<String>> = Vec::new();
    for raw in text.lines() {
        let line = strip_ansi(raw);
        let tokens: Vec<&str> = line.split_whitespace().collect();
        let Some(first) = tokens.first() else {
            continue;
        };
        if gpu_columns.is_none() {
            if *first == "GPU0" {
                // The header: GPU columns come first, then NICs and the affinity titles.
                let n = tokens
                    .iter()
                    .take_while(|t| t.starts_with("GPU") && t[3..].parse::<usize>().is_ok())
                    .count();
                gpu_columns = Some(n);
            }
            continue;
        }
        if first.starts_with("GPU") && first[3..].parse::<usize>().is_ok() {
            rows.push(tokens.iter().map(|t| t.to_string()).collect());
        } else if first.starts_with("Legend") {
            break;
        }
    }
    let n = gpu_columns.ok_or(TopologyError::NoHeader)?;
    if n == 0 || rows.is_empty() {
        return Err(TopologyError::Empty);
    }
    for (i, row) in rows.iter().enumerate() {
        if row[0] != format!("GPU{i}") {
            return Err(TopologyError::RowOrder {
                expected_last: rows.len() - 1,
                found: row[0].clone(),
            });
        }
        if row.len() < 1 + n {
            return Err(TopologyError::ShortRow {
                row: row[0].clone(),
                found: row.len() - 1,
                expected: n,
            });
        }
    }
    Ok((n, rows))
}

impl Topology {
    /// Parses `nvidia-smi topo -m` output.
    ///
    /// NIC columns and rows are ignored; the "NUMA Affinity" column, when present, fills
    /// [`GpuPlacement::numa_node`].
    pub fn from_nvidia_smi(text: &str) -> Result<Self, TopologyError> {
        let (n, rows) = matrix_rows(text)?;
        let header_has_numa = text
            .lines()
            .any(|l| strip_ansi(l).contains("NUMA Affinity"));
        let mut links = vec![vec![LinkKind::SelfLink; n]; n];
        let mut gpus = Vec::with_capacity(n);
        for (a, row) in rows.iter().enumerate().take(n) {
            // Link columns: all devices (GPUs and NICs) come before the affinity columns. We only
            // need the first n (GPUs).
            for b in 0..n {
                links[a][b] = row[1 + b].parse()?;
            }
            // Affinity columns are the trailing tokens: CPU affinity, NUMA affinity, GPU NUMA ID.
            // Their count varies across driver versions, so read NUMA Affinity from the end.
            let numa_node = if header_has_numa {
                let tail: Vec<&String> = row
                    .iter()
                    .skip(1)
                    .filter(|t| t.parse::<LinkKind>().is_err())
                    .collect();
                // With "GPU NUMA ID" the NUMA affinity is second to last, otherwise last.
                let has_gpu_numa_id = text.contains("GPU NUMA ID");
                let idx = if has_gpu_numa_id {
                    tail.len().checked_sub(2)
                } else {
                    tail.len().checked_sub(1)
                };
                idx.and_then(|i| tail[i].parse().ok())
            } else {
                None
            };
            gpus.push(GpuPlacement {
                index: a,
                numa_node,
                ..Default::default()
            });
        }
        let topo = Topology {
            gpus,
            links,
            p2p: None,
        };
        topo.validate()?;
        Ok(topo)
    }

    /// Parses GPU sysfs paths, one per line, optionally followed by the NUMA node:
    ///
    /// ```text
    /// # for d in $(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader); do
    /// #   p=/sys/bus/pci/devices/${d,,}; p=${p/0000000/0000}; echo "$(readlink -f $p) $(cat $p/numa_node)"; done
    /// /sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:05:00.0 0
    /// ```
    ///
    /// Lines are in CUDA index order. Link kinds are derived from the tree: a shared bridge below
    /// the root port means one switch (PIX if each GPU sits one downstream port below the
    /// deepest shared bridge, PXB otherwise); the same root complex without a shared bridge is
    /// PHB; different root complexes on one NUMA node are NODE; different NUMA nodes are SYS.
    pub fn from_sysfs_paths(text: &str) -> Result<Self, TopologyError> {
        let mut gpus = Vec::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut parts = line.split_whitespace();
            let path = parts.next().unwrap_or_default();
            let numa_node = parts
                .next()
                .and_then(|t| t.parse::<i64>().ok())
                .and_then(|n| u32::try_from(n).ok());
            let rest = path
                .strip_prefix("/sys/devices/")
                .ok_or_else(|| TopologyError::BadSysfsPath(path.into()))?;
            let mut components = rest.split('/').filter(|c| !c.is_empty());
            let root = components
                .next()
                .filter(|c| c.starts_with("pci"))
                .ok_or_else(|| TopologyError::BadSysfsPath(path.into()))?;
            let mut chain: Vec<String> = components.map(str::to_string).collect();
            let bus_id = chain
                .pop()
                .ok_or_else(|| TopologyError::BadSysfsPath(path.into()))?;
            gpus.push(GpuPlacement {
                index: gpus.len(),
                numa_node,
                root_complex: Some(root.to_string()),
                bridges: chain,
                bus_id: Some(bus_id),
            });
        }
        if gpus.is_empty() {
            return Err(TopologyError::Empty);
        }
        let n = gpus.len();
        let mut links = vec![vec![LinkKind::SelfLink; n]; n];
        for a in 0..n {
            for b in 0..n {
                if a != b {
                    links[a][b] = sysfs_link(&gpus[a], &gpus[b]);
                }
            }
        }
        let topo = Topology {
            gpus,
            links,
            p2p: None,
        };
        topo.validate()?;
        Ok(topo)
    }

    /// Builds a topology from a matrix, for tests and the simulator.
    pub fn from_links(links: Vec<Vec<LinkKind>>) -> Result<Self, TopologyError> {
        let gpus = (0..links.len())
            .map(|index| GpuPlacement {
                index,
                ..Default::default()
            })
            .collect();
        let topo = Topology {
            gpus,
            links,
            p2p: None,
        };
        topo.validate()?;
        Ok(topo)
    }

    /// Merges a `nvidia-smi topo -p2p <r|w|a>` matrix into [`Topology::p2p`].
    pub fn merge_p2p(&mut self, text: &str, kind: P2pKind) -> Result<(), TopologyError> {
        let (n, rows) = matrix_rows(text)?;
        if n != self.len() {
            return Err(TopologyError::P2pSize {
                found: n,
                expected: self.len(),
            });
        }
        let p2p = self
            .p2p
            .get_or_insert_with(|| vec![vec![P2pCapability::default(); n]; n]);
        for (a, row) in rows.iter().enumerate().take(n) {
            for b in 0..n {
                let ok = match row[1 + b].as_str() {
                    "X" | "OK" => true,
                    "NS" | "CNS" | "GNS" | "TNS" | "U" => false,
                    other => return Err(TopologyError::UnknownP2p(other.into())),
                };
                let cap = &mut p2p[a][b];
                match kind {
                    P2pKind::Read => cap.read = ok,
                    P2pKind::Write => cap.write = ok,
                    P2pKind::Atomics => cap.atomics = ok,
                }
            }
        }
        Ok(())
    }

    fn validate(&self) -> Result<(), TopologyError> {
        let n = self.links.len();
        if n == 0 {
            return Err(TopologyError::Empty);
        }
        for a in 0..n {
            if self.links[a].len() != n {
                return Err(TopologyError::ShortRow {
                    row: format!("GPU{a}"),
                    found: self.links[a].len(),
                    expected: n,
                });
            }
            if self.links[a][a] != LinkKind::SelfLink {
                return Err(TopologyError::Diagonal(a));
            }
            for b in 0..a {
                let (ab, ba) = (self.links[a][b], self.links[b][a]);
                if ab != ba {
                    return Err(TopologyError::Asymmetric { a, b, ab, ba });
                }
            }
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.links.len()
    }

    pub fn is_empty(&self) -> bool {
        self.links.is_empty()
    }

    pub fn link(&self, a: usize, b: usize) -> LinkKind {
        self.links[a][b]
    }

    /// The first `n` GPUs, for running on a subset of a host.
    pub fn prefix(&self, n: usize) -> Topology {
        Topology {
            gpus: self.gpus[..n].to_vec(),
            links: self.links[..n]
                .iter()
                .map(|row| row[..n].to_vec())
                .collect(),
            p2p: self
                .p2p
                .as_ref()
                .map(|m| m[..n].iter().map(|row| row[..n].to_vec()).collect()),
        }
    }

    /// Groups GPUs into islands at `level`: connected components of the "joined" relation,
    /// each sorted, islands ordered by their smallest GPU. The order is part of the
    /// island-hierarchical algorithm's fixed reduction order.
    pub fn islands(&self, level: IslandLevel) -> Islands {
        let n = self.len();
        let mut parent: Vec<usize> = (0..n).collect();
        fn find(parent: &mut [usize], x: usize) -> usize {
            let mut r = x;
            while parent[r] != r {
                r = parent[r];
            }
            parent[x] = r;
            r
        }
        for a in 0..n {
            for b in 0..a {
                if level.joins(self.links[a][b]) {
                    let (ra, rb) = (find(&mut parent, a), find(&mut parent, b));
                    parent[ra.max(rb)] = ra.min(rb);
                }
            }
        }
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut root_to_group = vec![usize::MAX; n];
        for g in 0..n {
            let r = find(&mut parent, g);
            if root_to_group[r] == usize::MAX {
                root_to_group[r] = groups.len();
                groups.push(Vec::new());
            }
            groups[root_to_group[r]].push(g);
        }
        Islands::new(groups).expect("components partition 0..n")
    }

    /// The islands the hierarchical all-reduce should use: sockets when there is more than one,
    /// otherwise switches. The slowest links are the ones to cross only once.
    pub fn hierarchy_islands(&self) -> Islands {
        let sockets = self.islands(IslandLevel::Socket);
        if sockets.len() > 1 {
            sockets
        } else {
            self.islands(IslandLevel::Switch)
        }
    }

    /// True when any pair's traffic crosses a root complex (where posted writes may collapse).
    pub fn any_root_complex_crossing(&self) -> bool {
        self.links
            .iter()
            .flatten()
            .any(|l| l.crosses_root_complex())
    }

    /// Prints the matrix in `nvidia-smi topo -m` layout (GPU columns only).
    pub fn to_matrix_text(&self) -> String {
        let n = self.len();
        let mut s = String::from("     ");
        for b in 0..n {
            s += &format!("\tGPU{b}");
        }
        s += "\n";
        for a in 0..n {
            s += &format!("GPU{a}");
            for b in 0..n {
                s += &format!("\t{}", self.links[a][b]);
            }
            s += "\n";
        }
        s
    }
}

/// Which `-p2p` matrix is being merged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum P2pKind {
    Read,
    Write,
    Atomics,
}

fn sysfs_link(a: &GpuPlacement, b: &GpuPlacement) -> LinkKind {
    if a.root_complex != b.root_complex {
        return match (a.numa_node, b.numa_node) {
            (Some(x), Some(y)) if x == y => LinkKind::Node,
            // Unknown NUMA: assume the worst, the caller can still override.
            _ => LinkKind::Sys,
        };
    }
    let common = a
        .bridges
        .iter()
        .zip(&b.bridges)
        .take_while(|(x, y)| x == y)
        .count();
    // bridges[0] is the root port. Sharing only it cannot happen without a switch below it, so
    // sharing any bridge means a switch; sharing none means the host bridge joins them.
    if common == 0 {
        return LinkKind::Phb;
    }
    let below_a = a.bridges.len() - common;
    let below_b = b.bridges.len() - common;
    if below_a <= 1 && below_b <= 1 {
        LinkKind::Pix
    } else {
        LinkKind::Pxb
    }
}

/// A partition of ranks `0..n` into islands, in a fixed order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Islands {
    groups: Vec<Vec<usize>>,
    island_of: Vec<usize>,
    position_of: Vec<usize>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("islands {groups:?} are not a partition of ranks 0..{world_size}")]
pub struct IslandsError {
    pub groups: Vec<Vec<usize>>,
    pub world_size: usize,
}

impl Islands {
    /// Validates that `groups` partition `0..n` with no empty group; keeps the given order.
    pub fn new(groups: Vec<Vec<usize>>) -> Result<Self, IslandsError> {
        let n: usize = groups.iter().map(Vec::len).sum();
        let bad = || IslandsError {
            groups: groups.clone(),
            world_size: n,
        };
        let mut island_of = vec![usize::MAX; n];
        let mut position_of = vec![usize::MAX; n];
        for (i, g) in groups.iter().enumerate() {
            if g.is_empty() {
                return Err(bad());
            }
            for (p, &r) in g.iter().enumerate() {
                if r >= n || island_of[r] != usize::MAX {
                    return Err(bad());
                }
                island_of[r] = i;
                position_of[r] = p;
            }
        }
        Ok(Islands {
            groups,
            island_of,
            position_of,
        })
    }

    /// One island holding all ranks.
    pub fn single(n: usize) -> Self {
        Islands::new(vec![(0..n).collect()]).expect("one island is a partition")
    }

    /// Contiguous islands of the given sizes: `[4, 4]` → `{0..4}, {4..8}`.
    pub fn contiguous(sizes: &[usize]) -> Result<Self, IslandsError> {
        let mut start = 0;
        let groups = sizes
            .iter()
            .map(|&s| {
                let g = (start..start + s).collect();
                start += s;
                g
            })
            .collect();
        Islands::new(groups)
    }

    pub fn groups(&self) -> &[Vec<usize>] {
        &self.groups
    }
    pub fn len(&self) -> usize {
        self.groups.len()
    }
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }
    pub fn world_size(&self) -> usize {
        self.island_of.len()
    }
    pub fn island_of(&self, rank: usize) -> usize {
        self.island_of[rank]
    }
    pub fn position_of(&self, rank: usize) -> usize {
        self.position_of[rank]
    }

    /// Compact text form, `0,1,2,3/4,5,6,7`, used on command lines.
    pub fn to_spec(&self) -> String {
        self.groups
            .iter()
            .map(|g| g.iter().map(usize::to_string).collect::<Vec<_>>().join(","))
            .collect::<Vec<_>>()
            .join("/")
    }

    /// Parses [`Islands::to_spec`]'s form.
    pub fn from_spec(spec: &str) -> Result<Self, IslandsError> {
        let groups: Vec<Vec<usize>> = spec
            .split('/')
            .map(|g| g.split(',').filter_map(|r| r.trim().parse().ok()).collect())
            .collect();
        Islands::new(groups)
    }
}

/// Captured-style host descriptions of 8-GPU PCIe hosts, for tests and the simulator.
pub mod fixtures {
    /// Two PCIe switches (4 GPUs each) under one socket, on different root complexes.
    pub const TWO_SWITCHES_ONE_SOCKET: &str =
        include_str!("fixtures/topo-two-switches-one-socket.txt");
    /// One switch of 4 GPUs per socket, two sockets; a NIC on each switch.
    pub const TWO_SOCKETS_4X4: &str = include_str!("fixtures/topo-two-sockets-4x4.txt");
    /// No switches: every GPU on its own root complex, 4 per socket.
    pub const NO_SWITCHES: &str = include_str!("fixtures/topo-no-switches.txt");
    /// Socket 0: a switch of 3 GPUs plus one GPU on its own root complex; socket 1: a two-level
    /// switch tree of 2 + 2.
    pub const MIXED: &str = include_str!("fixtures/topo-mixed.txt");
    pub const SYSFS_TWO_SOCKETS_4X4: &str = include_str!("fixtures/sysfs-two-sockets-4x4.txt");
    pub const SYSFS_MIXED: &str = include_str!("fixtures/sysfs-mixed.txt");
    pub const P2P_READ_TWO_SOCKETS_4X4: &str =
        include_str!("fixtures/p2p-read-two-sockets-4x4.txt");
    pub const P2P_ATOMICS_TWO_SOCKETS_4X4: &str =
        include_str!("fixtures/p2p-atomics-two-sockets-4x4.txt");

    /// The `nvidia-smi topo -m` fixtures by name.
    pub const NAMED: [(&str, &str); 4] = [
        ("two-sockets-4x4", TWO_SOCKETS_4X4),
        ("two-switches-one-socket", TWO_SWITCHES_ONE_SOCKET),
        ("no-switches", NO_SWITCHES),
        ("mixed", MIXED),
    ];

    pub fn named(name: &str) -> Option<&'static str> {
        NAMED
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, text)| *text)
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{
        MIXED, NO_SWITCHES, P2P_ATOMICS_TWO_SOCKETS_4X4 as P2P_ATOMICS,
        P2P_READ_TWO_SOCKETS_4X4 as P2P_READ, SYSFS_MIXED,
        SYSFS_TWO_SOCKETS_4X4 as SYSFS_TWO_SOCKETS, TWO_SOCKETS_4X4, TWO_SWITCHES_ONE_SOCKET,
    };
    use super::*;

    fn groups(t: &Topology, level: IslandLevel) -> Vec<Vec<usize>> {
        t.islands(level).groups().to_vec()
    }

    #[test]
    fn two_switches_under_one_socket() {
        let t = Topology::from_nvidia_smi(TWO_SWITCHES_ONE_SOCKET).unwrap();
        assert_eq!(t.len(), 8);
        assert_eq!(t.link(0, 3), LinkKind::Pix);
        assert_eq!(t.link(0, 4), LinkKind::Node);
        assert_eq!(
            groups(&t, IslandLevel::Switch),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
        assert_eq!(
            groups(&t, IslandLevel::Socket),
            vec![(0..8).collect::<Vec<_>>()]
        );
        // One socket: the hierarchy falls back to switches.
        assert_eq!(
            t.hierarchy_islands().groups(),
            &[vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
        assert!(t.gpus.iter().all(|g| g.numa_node == Some(0)));
    }

    #[test]
    fn four_plus_four_across_two_sockets() {
        let t = Topology::from_nvidia_smi(TWO_SOCKETS_4X4).unwrap();
        assert_eq!(t.link(1, 2), LinkKind::Pix);
        assert_eq!(t.link(3, 4), LinkKind::Sys);
        assert_eq!(
            groups(&t, IslandLevel::Switch),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
        assert_eq!(
            groups(&t, IslandLevel::Socket),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
        assert_eq!(t.gpus[5].numa_node, Some(1));
    }

    #[test]
    fn no_switches_every_gpu_on_its_own_root_port() {
        let t = Topology::from_nvidia_smi(NO_SWITCHES).unwrap();
        assert_eq!(t.link(0, 1), LinkKind::Node);
        assert_eq!(t.link(0, 7), LinkKind::Sys);
        assert_eq!(
            groups(&t, IslandLevel::Switch),
            (0..8).map(|g| vec![g]).collect::<Vec<_>>()
        );
        assert_eq!(
            groups(&t, IslandLevel::Socket),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
        assert!(t.any_root_complex_crossing());
    }

    #[test]
    fn mixed_switch_tree_and_direct_gpu() {
        let t = Topology::from_nvidia_smi(MIXED).unwrap();
        assert_eq!(t.link(4, 6), LinkKind::Pxb);
        assert_eq!(t.link(0, 3), LinkKind::Node);
        assert_eq!(
            groups(&t, IslandLevel::Switch),
            vec![vec![0, 1, 2], vec![3], vec![4, 5, 6, 7]]
        );
        assert_eq!(
            groups(&t, IslandLevel::Socket),
            vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7]]
        );
    }

    #[test]
    fn sysfs_paths_agree_with_the_matrix() {
        let from_sysfs = Topology::from_sysfs_paths(SYSFS_TWO_SOCKETS).unwrap();
        let from_smi = Topology::from_nvidia_smi(TWO_SOCKETS_4X4).unwrap();
        assert_eq!(
            from_sysfs.links,
            from_smi.links,
            "\n{}\n{}",
            from_sysfs.to_matrix_text(),
            from_smi.to_matrix_text()
        );
        assert_eq!(
            from_sysfs.gpus[4].root_complex.as_deref(),
            Some("pci0000:80")
        );
        assert_eq!(from_sysfs.gpus[4].bus_id.as_deref(), Some("0000:85:00.0"));

        let mixed_sysfs = Topology::from_sysfs_paths(SYSFS_MIXED).unwrap();
        let mixed_smi = Topology::from_nvidia_smi(MIXED).unwrap();
        assert_eq!(
            mixed_sysfs.links,
            mixed_smi.links,
            "\n{}\n{}",
            mixed_sysfs.to_matrix_text(),
            mixed_smi.to_matrix_text()
        );
    }

    #[test]
    fn p2p_matrices_merge() {
        let mut t = Topology::from_nvidia_smi(TWO_SOCKETS_4X4).unwrap();
        t.merge_p2p(P2P_READ, P2pKind::Read).unwrap();
        t.merge_p2p(P2P_ATOMICS, P2pKind::Atomics).unwrap();
        let p2p = t.p2p.as_ref().unwrap();
        assert!(p2p[0][7].read);
        assert!(!p2p[0][1].atomics, "PCIe hosts have no peer atomics");
    }

    #[test]
    fn malformed_input_is_rejected_with_a_reason() {
        assert_eq!(
            Topology::from_nvidia_smi("nothing here"),
            Err(TopologyError::NoHeader)
        );
        let asym = "\tGPU0\tGPU1\nGPU0\tX\tPIX\nGPU1\tSYS\tX\n";
        assert!(matches!(
            Topology::from_nvidia_smi(asym),
            Err(TopologyError::Asymmetric { .. })
        ));
        let bad = "\tGPU0\tGPU1\nGPU0\tX\tFOO\nGPU1\tFOO\tX\n";
        assert_eq!(
            Topology::from_nvidia_smi(bad),
            Err(TopologyError::UnknownLink("FOO".into()))
        );
        assert!(matches!(
            Topology::from_sysfs_paths("/proc/x 0"),
            Err(TopologyError::BadSysfsPath(_))
        ));
    }

    #[test]
    fn island_specs_round_trip_and_reject_non_partitions() {
        let i = Islands::from_spec("0,1,2/3/4,5,6,7").unwrap();
        assert_eq!(i.to_spec(), "0,1,2/3/4,5,6,7");
        assert_eq!(i.island_of(3), 1);
        assert_eq!(i.position_of(6), 2);
        assert!(Islands::from_spec("0,1/1,2").is_err());
        assert!(Islands::from_spec("0,2").is_err());
    }
}
