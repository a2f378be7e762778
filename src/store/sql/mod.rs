//! What the SQL stores share: identifier validation, the row they read back, and everything
//! of the store but its claim, written once for both databases.

mod names;
mod row;
mod store;
#[cfg(test)]
mod tests;

pub use names::{CheckError, InvalidIdentifier};
pub(crate) use names::{derived_name, identifier, misshapen};
pub(crate) use row::{
    HELD_IN_TRANSACTION_MS, RawRecord, RowError, answer_lost, appended, claim_outcome, descending,
    from_millis, from_ticks, millis, ticks, token, unavailable,
};
pub(crate) use store::sql_store;
