use super::*;
use crate::store::{Claim, FencingToken, Record};

fn row(status: &str, token: i64) -> Record {
    RawRecord {
        scope: b"s".to_vec(),
        key: b"k".to_vec(),
        fingerprint: vec![7; 32],
        status: status.to_owned(),
        lease_token: token,
        lease_until_ms: 2_000,
        attempts: 2,
        effect_started: false,
        downstream_id: None,
        response: None,
        created_at_ms: 1_000,
        updated_at: from_millis(1_000),
        expires_at_ms: 9_000,
        history: String::new(),
        resolution_note: None,
    }
    .into_record()
    .expect("a readable row")
}

/// Issue 23 §4: a claim that finds its own token on a record in progress holds that lease
/// (a claim sent again after its answer was lost, or after a batch that wrote nothing);
/// another token, or its own token on a record no longer in progress, is what stands.
#[test]
fn s4_a_claim_that_finds_its_own_token_in_progress_holds_the_lease() {
    let now = from_millis(1_500);
    let mine = FencingToken::new(42);
    match claim_outcome(row("in_progress", 42), now, mine) {
        Claim::Acquired(lease) => {
            assert_eq!(lease.token, mine);
            assert_eq!(lease.attempt, 2, "the record's attempt");
            assert_eq!(lease.until, from_millis(2_000), "the record's lease");
        }
        other => panic!("its own lease, got {other:?}"),
    }
    for (status, token) in [
        ("in_progress", 41),
        ("completed", 42),
        ("released", 42),
        ("needs_reconciliation", 42),
    ] {
        assert!(
            matches!(
                claim_outcome(row(status, token), now, mine),
                Claim::Existing { .. } | Claim::Completed { .. }
            ),
            "{status} with token {token} is the record that stands"
        );
    }
}

/// Issue 15 §8: an index name derived from a 63-byte table name fits PostgreSQL's limit
/// and differs from the table's own name and from another long table's.
#[test]
fn derived_names_fit_and_stay_distinct() {
    let long = "t".repeat(63);
    let other = format!("{}u", "t".repeat(62));
    for table in [long.as_str(), other.as_str(), "short"] {
        let name = derived_name(table, "_expires_at");
        assert!(name.len() <= 63, "{name} is {} bytes", name.len());
        assert_ne!(name, table);
        assert!(name.ends_with("_expires_at"));
    }
    assert_ne!(
        derived_name(&long, "_expires_at"),
        derived_name(&other, "_expires_at")
    );
    assert_eq!(derived_name("short", "_expires_at"), "short_expires_at");
}

#[test]
fn hostile_identifiers_are_refused() {
    for ok in ["idempotency", "_t", "T_1", &"a".repeat(63)] {
        assert!(identifier(ok).is_ok(), "{ok}");
    }
    for bad in [
        "",
        "1abc",
        "a-b",
        "a b",
        "t\"; DROP TABLE x; --",
        "schema.table",
        "tâble",
        &"a".repeat(64),
    ] {
        assert!(identifier(bad).is_err(), "{bad}");
    }
}
