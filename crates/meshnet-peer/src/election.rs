//! Who takes over when the tracker goes silent (ADR-0018).
//!
//! The tracker publishes, with every coverage map, a succession list: ready peers with the
//! memory for the first layers, in its order of preference. When its maps stop for the
//! election timeout, each member on the list computes its rank among the listed members it
//! still hears from; the first takes over at once with the next term, the second one timeout
//! later if the first has not spoken by then, and so on. Every member that hears the same
//! announcements computes the same ranks, so one member claims first; if two claim the same
//! term anyway, the lower peer id wins ([`meshnet_types::claim_beats`], which every member's
//! gossip validation applies), and a higher term always wins. Only a member that still hears
//! a majority of the mesh claims ([`has_quorum`]): one cut off from the others must not become
//! the tracker of a partition of one. The majority counts only members whose latest
//! announcement reports the tracker silent as well ([`vouches_for_silence`]): a member cut off
//! a moment ago still holds fresh announcements from before the cut, and one back on the
//! network hears the others before the tracker's next map; neither is evidence that the tracker
//! is gone.
//! Pure logic: the caller passes in the list, who is alive, and the time.

use std::time::Duration;

use meshnet_types::PeerId;
#[cfg(test)]
use meshnet_types::claim_beats;

/// `me`'s place among the members of `succession` that are alive (0 = first in line), or
/// `None` when `me` is not on the list. Members not on the list never run.
pub fn rank(
    succession: &[PeerId],
    me: &PeerId,
    is_alive: impl Fn(&PeerId) -> bool,
) -> Option<usize> {
    let mut place = 0;
    for candidate in succession {
        if candidate == me {
            return Some(place);
        }
        if is_alive(candidate) {
            place += 1;
        }
    }
    None
}

/// Whether the members still heard make a majority of `members` (the peers of the tracker's
/// last coverage map other than the tracker): a member cut off from the mesh hears nobody and
/// must not make itself tracker of a partition of one, whose higher term would then win when
/// the partition heals. Members that hear more than half of the mesh are on the majority
/// side, and at most one side has a majority.
pub fn has_quorum(members: &[PeerId], is_alive: impl Fn(&PeerId) -> bool) -> bool {
    let heard = members.iter().filter(|member| is_alive(member)).count();
    heard * 2 > members.len()
}

/// Whether a member that reported, in its latest announcement, `reported_silence` since it
/// last heard the tracker (`None`: it follows none) backs a claim made after the election
/// `timeout`: it must have missed the tracker for half the timeout. A member announces once per
/// interval, a third of the timeout, so when the tracker is gone every live member's latest
/// announcement reports at least two intervals of silence by the time anyone claims.
pub fn vouches_for_silence(reported_silence: Option<Duration>, timeout: Duration) -> bool {
    reported_silence.is_some_and(|silence| silence >= timeout / 2)
}

/// Whether a member of rank `rank` claims the tracker role after the tracker has been silent
/// for `silence`, given the election `timeout`: rank 0 after one timeout, rank 1 after two, ...
pub fn claims_now(rank: usize, silence: Duration, timeout: Duration) -> bool {
    let waited = timeout.saturating_mul(u32::try_from(rank + 1).unwrap_or(u32::MAX));
    silence >= waited
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    /// The member of `succession` that takes over first, by the rule stated directly: the
    /// first one alive. [`rank`] must give it, and only it, rank 0.
    fn first_in_line(succession: &[PeerId], is_alive: impl Fn(&PeerId) -> bool) -> Option<&PeerId> {
        succession.iter().find(|candidate| is_alive(candidate))
    }

    fn ids(names: &[&str]) -> Vec<PeerId> {
        names.iter().map(|name| PeerId::new(*name)).collect()
    }

    #[test]
    fn only_a_majority_may_elect() {
        let mesh = ids(&["a", "b", "c", "d"]);
        assert!(has_quorum(&mesh, |p: &PeerId| p.as_str() != "d"));
        // Half is not a majority: two sides of two must not both elect.
        assert!(!has_quorum(&mesh, |p: &PeerId| p.as_str() < "c"));
        // Cut off: a member hears only itself.
        assert!(!has_quorum(&mesh, |p: &PeerId| p.as_str() == "a"));
        // The last peer of a two-member mesh takes over when the tracker dies.
        assert!(has_quorum(&ids(&["a"]), |_: &PeerId| true));
    }

    #[test]
    fn only_members_that_miss_the_tracker_too_back_a_claim() {
        let timeout = Duration::from_millis(1500);
        // Two intervals without a map: the tracker is gone for them too.
        assert!(vouches_for_silence(
            Some(Duration::from_millis(1000)),
            timeout
        ));
        assert!(vouches_for_silence(
            Some(Duration::from_millis(750)),
            timeout
        ));
        // Heard the tracker within the last interval (as a member's announcement from just
        // before this member was cut off says): no backing.
        assert!(!vouches_for_silence(
            Some(Duration::from_millis(400)),
            timeout
        ));
        assert!(!vouches_for_silence(None, timeout));
    }

    #[test]
    fn the_first_live_member_of_the_list_goes_first() {
        let list = ids(&["c", "a", "b"]);
        let alive = |peer: &PeerId| peer.as_str() != "c";
        assert_eq!(first_in_line(&list, alive).unwrap(), "a");
        assert_eq!(rank(&list, &PeerId::new("a"), alive), Some(0));
        assert_eq!(rank(&list, &PeerId::new("b"), alive), Some(1));
        assert_eq!(rank(&list, &PeerId::new("z"), alive), None);
        let second = Duration::from_secs(2);
        assert!(!claims_now(1, second, second));
        assert!(claims_now(1, second * 2, second));
        assert!(claims_now(0, second, second));
    }

    proptest! {
        /// Whatever order announcements arrive in (so whatever order members learn who is
        /// alive), members with the same view agree on one winner, and exactly one member
        /// has rank 0.
        #[test]
        fn any_order_of_announcements_elects_one_member(
            list in prop::collection::btree_set(0u8..20, 1..8),
            order in any::<prop::sample::Index>(),
            dead in prop::collection::btree_set(0u8..20, 0..6),
        ) {
            let mut succession: Vec<PeerId> = list.iter().map(|n| PeerId::new(format!("p{n:02}"))).collect();
            // The tracker's order of preference, not the ids' order.
            let rotate = order.index(succession.len());
            succession.rotate_left(rotate);
            let dead: BTreeSet<PeerId> = dead.iter().map(|n| PeerId::new(format!("p{n:02}"))).collect();
            // Announcements seen in some order: the set of live members is the same at the end.
            let mut heard: Vec<&PeerId> = succession.iter().filter(|p| !dead.contains(*p)).collect();
            heard.reverse();
            let alive_set: BTreeSet<&PeerId> = heard.into_iter().collect();
            let alive = |peer: &PeerId| alive_set.contains(peer);
            let firsts: Vec<&PeerId> = succession
                .iter()
                .filter(|me| alive(me) && rank(&succession, me, alive) == Some(0))
                .collect();
            match first_in_line(&succession, alive) {
                Some(winner) => prop_assert_eq!(firsts, vec![winner]),
                None => prop_assert!(firsts.is_empty()),
            }
        }

        /// However a mesh splits in two, at most one side has a quorum.
        #[test]
        fn at_most_one_side_of_a_split_has_a_quorum(
            mesh in prop::collection::btree_set(0u8..40, 1..20),
            side in prop::collection::btree_set(0u8..40, 0..20),
        ) {
            let members: Vec<PeerId> = mesh.iter().map(|n| PeerId::new(format!("p{n:02}"))).collect();
            let one: BTreeSet<PeerId> = side.iter().map(|n| PeerId::new(format!("p{n:02}"))).collect();
            let this_side = has_quorum(&members, |p| one.contains(p));
            let other_side = has_quorum(&members, |p| !one.contains(p));
            prop_assert!(!(this_side && other_side));
        }

        /// Of any set of claims, exactly one beats all others.
        #[test]
        fn any_set_of_claims_has_one_winner(
            claims in prop::collection::btree_map(0u8..50, 1u64..4, 1..6),
        ) {
            let claims: Vec<(PeerId, u64)> = claims
                .into_iter()
                .map(|(n, term)| (PeerId::new(format!("p{n:02}")), term))
                .collect();
            let winners: Vec<&PeerId> = claims
                .iter()
                .filter(|(peer, term)| {
                    claims
                        .iter()
                        .filter(|(other, _)| other != peer)
                        .all(|(other, other_term)| claim_beats(peer, *term, other, *other_term))
                })
                .map(|(peer, _)| peer)
                .collect();
            prop_assert_eq!(winners.len(), 1);
            let top = claims.iter().map(|(_, term)| *term).max().unwrap();
            let winner_term = claims.iter().find(|(peer, _)| peer == winners[0]).unwrap().1;
            prop_assert_eq!(winner_term, top);
        }
    }
}
