//! Whether the guest makes progress, for `kpin status`: the vCPU loop takes a [`Sample`]
//! every [`PROGRESS_SAMPLE`] (see `windows.rs`, which also nudges the engine so that its
//! published instruction count is current), and [`judge_progress`] compares the last two.

use std::time::{Duration, Instant};

/// How often the loop samples the guest's progress (and nudges the engine to publish its
/// live instruction count) for `kpin status`.
pub const PROGRESS_SAMPLE: Duration = Duration::from_secs(1);
/// Exits between two samples with no guest instruction executed that make a guest under
/// the engine `stalled`. Well above what the control channel's own kicks cause (a few
/// per request), far below an exit storm (thousands a second).
pub const STALL_EXITS: u64 = 1_000;

/// The guest's progress at one moment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// When it was taken.
    pub at: Instant,
    /// `KVM_RUN` returns so far.
    pub exits: u64,
    /// Guest instructions under the engine so far, as last published (`None`: the guest
    /// runs natively, where nothing counts them).
    pub insns: Option<u64>,
}

/// Whether the guest makes progress (`kpin status`'s `progress`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Progress {
    /// Guest instructions were executed between the samples.
    Advancing,
    /// None, and few exits: the guest is halted or waits.
    Idle,
    /// None while exits climbed: a livelock or an exit storm.
    Stalled,
    /// Not measurable: the guest ran natively, or there are not two samples yet.
    Unmeasured,
}

impl Progress {
    /// The name `kpin status` prints.
    pub fn name(self) -> &'static str {
        match self {
            Progress::Advancing => "advancing",
            Progress::Idle => "idle",
            Progress::Stalled => "stalled",
            Progress::Unmeasured => "unmeasured",
        }
    }
}

/// Judges progress between two samples, with the numbers behind the judgement.
pub fn judge_progress(older: Option<Sample>, newer: Option<Sample>) -> (Progress, String) {
    let (Some(a), Some(b)) = (older, newer) else {
        return (
            Progress::Unmeasured,
            "no two progress samples yet (one is taken every second)".into(),
        );
    };
    let secs = b.at.duration_since(a.at).as_secs_f64();
    let exits = b.exits.saturating_sub(a.exits);
    let (Some(i0), Some(i1)) = (a.insns, b.insns) else {
        return (
            Progress::Unmeasured,
            format!(
                "the guest ran natively, where instructions are not counted; {exits} exits in {secs:.1} s"
            ),
        );
    };
    // A count that went down is a new engine instance's: something ran.
    if i1 != i0 {
        let n = i1.saturating_sub(i0);
        return (
            Progress::Advancing,
            format!("{n} guest instructions and {exits} exits in {secs:.1} s"),
        );
    }
    if exits >= STALL_EXITS {
        return (
            Progress::Stalled,
            format!(
                "no guest instruction executed in {secs:.1} s while {exits} exits happened (a livelock or an exit storm: the guest is stuck at {i1} instructions)"
            ),
        );
    }
    (
        Progress::Idle,
        format!("no guest instruction executed in {secs:.1} s, {exits} exits: halted or waiting"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn test_progress_is_judged_from_two_samples() {
        let t0 = Instant::now();
        let at = |ms, exits, insns| {
            Some(Sample {
                at: t0 + Duration::from_millis(ms),
                exits,
                insns,
            })
        };
        let judge = |a, b| judge_progress(a, b).0;
        assert_eq!(judge(None, at(0, 0, Some(0))), Progress::Unmeasured);
        assert_eq!(
            judge(at(0, 0, None), at(1000, 9, None)),
            Progress::Unmeasured
        );
        assert_eq!(
            judge(at(0, 10, Some(5)), at(1000, 5000, Some(6))),
            Progress::Advancing
        );
        // A switch to a new window's engine restarts its count.
        assert_eq!(
            judge(at(0, 10, Some(50_000)), at(1000, 20, Some(7))),
            Progress::Advancing
        );
        assert_eq!(
            judge(at(0, 10, Some(5)), at(1000, 10 + STALL_EXITS - 1, Some(5))),
            Progress::Idle
        );
        let (p, why) = judge_progress(at(0, 10, Some(5)), at(1000, 10 + 2_000_000, Some(5)));
        assert_eq!(p, Progress::Stalled);
        assert!(why.contains("2000000 exits"), "{why}");
    }
}
