//! The names a SQL store puts in its statements, and the table it expects to find.

use std::fmt;

/// A schema or table name that is not a plain SQL identifier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidIdentifier(pub(crate) String);

impl fmt::Display for InvalidIdentifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not a valid identifier: use 1 to 63 ASCII letters, digits and underscores, \
             not starting with a digit",
            self.0
        )
    }
}

impl std::error::Error for InvalidIdentifier {}

/// Why a SQL store cannot serve: the database is out of reach, or its table is not there.
#[derive(Debug)]
#[non_exhaustive]
pub enum CheckError {
    /// The database could not be queried.
    Unreachable(sqlx::Error),
    /// The table (or its indexes) is missing: run the store's `migrate()` first.
    NotMigrated {
        /// The table the store was configured with.
        table: String,
    },
    /// The table is there but is not the store's: columns it reads are missing, or columns it
    /// never writes are required (made by hand, or another application's table of that name).
    Misshapen {
        /// The table the store was configured with.
        table: String,
        /// What is wrong with it.
        detail: String,
    },
}

impl fmt::Display for CheckError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unreachable(e) => {
                write!(f, "the idempotency store's database is unreachable: {e}")
            }
            Self::NotMigrated { table } => write!(
                f,
                "the idempotency store's table {table} (or its indexes) does not exist: run \
                 `store.migrate().await` at start-up, or apply `store.migration_sql()` with your \
                 own migrations; until then every guarded request is answered 503"
            ),
            Self::Misshapen { table, detail } => write!(
                f,
                "the idempotency store's table {table} is not the one `migrate()` makes \
                 ({detail}): every guarded request would be answered 503; give the store a \
                 table of its own (`with_table`) and migrate it"
            ),
        }
    }
}

impl std::error::Error for CheckError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Unreachable(e) => Some(e),
            Self::NotMigrated { .. } | Self::Misshapen { .. } => None,
        }
    }
}

/// Accepts `[A-Za-z_][A-Za-z0-9_]{0,62}`: names that need no quoting and cannot smuggle SQL.
pub(crate) fn identifier(name: &str) -> Result<&str, InvalidIdentifier> {
    let mut chars = name.chars();
    let valid = name.len() <= 63
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if valid {
        Ok(name)
    } else {
        Err(InvalidIdentifier(name.to_owned()))
    }
}

/// The name of an object derived from a table's (an index), within the 63 bytes PostgreSQL
/// keeps: a long table name is shortened and followed by a hash of the whole name, so the
/// derived name never collapses into the table's own, nor into another table's.
pub(crate) fn derived_name(table: &str, suffix: &str) -> String {
    const MAX: usize = 63;
    if table.len() + suffix.len() <= MAX {
        return format!("{table}{suffix}");
    }
    // FNV-1a: stable across builds and platforms, unlike std's hasher.
    let hash = table.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let tag = format!("_{:08x}", hash as u32);
    // Identifiers are ASCII (see `identifier`), so any byte index is a char boundary.
    let keep = MAX - suffix.len() - tag.len();
    format!("{}{tag}{suffix}", &table[..keep])
}

/// The columns of the table `migrate()` makes, on every database.
const TABLE_COLUMNS: &[&str] = &[
    "scope",
    "key",
    "fingerprint",
    "status",
    "lease_token",
    "lease_until",
    "attempts",
    "effect_started",
    "downstream_id",
    "response",
    "created_at",
    "updated_at",
    "expires_at",
    "history",
    "reconcile_on_expiry",
    "resolution_note",
];

/// Whether a table's `columns` (each with whether a row must give it a value: `NOT NULL`
/// without a default, not generated) are the store's, [`TABLE_COLUMNS`] and the database's
/// `own`: none missing, none more that the store's inserts would leave empty. What is wrong,
/// if anything.
pub(crate) fn misshapen(own: &[&str], columns: &[(String, bool)]) -> Option<String> {
    let expected = || TABLE_COLUMNS.iter().chain(own);
    let missing: Vec<&str> = expected()
        .filter(|name| !columns.iter().any(|(column, _)| column == *name))
        .copied()
        .collect();
    let required: Vec<&str> = columns
        .iter()
        .filter(|(column, required)| *required && !expected().any(|name| name == column))
        .map(|(column, _)| column.as_str())
        .collect();
    let mut wrong = Vec::new();
    if !missing.is_empty() {
        wrong.push(format!("missing columns: {}", missing.join(", ")));
    }
    if !required.is_empty() {
        wrong.push(format!(
            "columns the store never writes but a row must have: {}",
            required.join(", ")
        ));
    }
    (!wrong.is_empty()).then(|| wrong.join("; "))
}
