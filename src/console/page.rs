//! The pages: the list, one record, and the forms that settle it.

use std::fmt::Write as _;
use std::time::SystemTime;

use axum::body::{Body, Bytes};
use axum::extract::{OriginalUri, Request, State};
use http::{Method, Response, StatusCode};

use crate::key::hex;
use crate::reconcile::downstream_key;
use crate::store::IdempotencyStore;

use super::origin::{forbidden, read_body, same_origin};
use super::respond::{enc, esc, html, list_url, record_link, see_other};
use super::settle::UNREADABLE;
use super::settle::{Settle, key_from, key_ref, remove_by_hand};
use super::{Console, base, cursor_text, last_resolution, listing, millis, param, query_pairs};

pub(super) async fn page_list<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    original: OriginalUri,
    req: Request,
) -> Response<Body> {
    let base = base(&original, &req);
    let pairs = query_pairs(&req);
    let newest = param(&pairs, "order") == Some("newest");
    let list = list_url(&base);
    let listed = match listing(&console, &pairs).await {
        Ok(listed) => listed,
        Err(error) => return error.into_response(),
    };
    let now = SystemTime::now();
    let mut out = String::new();
    let _ = write!(
        out,
        "<h1>Awaiting reconciliation</h1><p><strong id=\"count\">{}</strong> records{}. \
         Order: <a href=\"{list}?order=oldest\">oldest first</a> · \
         <a href=\"{list}?order=newest\">newest first</a></p>",
        listed.count,
        listed.oldest.map_or(String::new(), |oldest| format!(
            ", the oldest waiting {} s",
            now.duration_since(oldest).map_or(0, |d| d.as_secs())
        )),
    );
    let _ = write!(
        out,
        "<form method=\"get\" action=\"{base}/record\"><strong>Find a key</strong>\
         <label>Scope <input name=\"scope\" id=\"find-scope\"></label>\
         <label>Key <input name=\"key\" id=\"find-key\" required></label>\
         <button type=\"submit\">Inspect</button></form>"
    );
    out.push_str(
        "<table id=\"uncertain\"><tr><th>key</th><th>scope</th><th>age</th><th>attempts</th>\
         <th>downstream id</th><th>last event</th></tr>",
    );
    for record in &listed.records {
        let _ = write!(
            out,
            "<tr><td><a class=\"record\" href=\"{}\">{}</a></td><td>{}</td><td>{} s</td><td>{}</td>\
             <td>{}</td><td>{}</td></tr>",
            esc(&record_link(&base, &record.key)),
            esc(record.key.key()),
            esc(record.key.scope()),
            now.duration_since(record.updated_at)
                .map_or(0, |d| d.as_secs()),
            record.attempts,
            esc(record.downstream_id.as_deref().unwrap_or("")),
            esc(record.history.last().map_or("", |h| h.event.as_str())),
        );
    }
    out.push_str("</table>");
    for (key, error) in &listed.unreadable {
        let _ = write!(
            out,
            "<p class=\"warn\">Unreadable record {} / {}: {}</p>",
            esc(key.scope()),
            esc(key.key()),
            esc(error)
        );
    }
    if let Some(next) = &listed.next {
        let order = if newest { "newest" } else { "oldest" };
        let _ = write!(
            out,
            "<p><a id=\"next\" href=\"{list}?order={order}&amp;limit={}&amp;after={}\">next page</a></p>",
            listed.limit,
            esc(&enc(&cursor_text(next)))
        );
    }
    let _ = write!(
        out,
        "<form method=\"post\" action=\"{base}/purge\"><button type=\"submit\">Purge expired \
         records</button></form>"
    );
    html(StatusCode::OK, "Awaiting reconciliation", &out)
}

pub(super) async fn page_record<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    original: OriginalUri,
    req: Request,
) -> Response<Body> {
    let base = base(&original, &req);
    let pairs = query_pairs(&req);
    let key = match key_from(|n| param(&pairs, n).map(str::to_owned)) {
        Ok(key) => key,
        Err(why) => return html(StatusCode::BAD_REQUEST, "Bad request", &esc(&why)),
    };
    let record = match console.store.lookup(&key).await {
        Ok(Some(record)) => record,
        Ok(None) => {
            let body = format!(
                "<h1>No record</h1><p>No record for key {} in scope {}.</p><p><a href=\"{}\">back</a></p>",
                esc(key.key()),
                esc(key.scope()),
                list_url(&base)
            );
            return html(StatusCode::NOT_FOUND, "No record", &body);
        }
        // A store that failed says nothing of the record: nothing to show, and nothing to
        // offer to remove (an intact record removed runs its key's next request again).
        Err(error) if !crate::store::is_corrupt(&error) => {
            tracing::error!(%error, "operator console: the store failed");
            let body = format!(
                "<h1>The store failed</h1><p class=\"warn\" id=\"error\">The record of key {} \
                 could not be read: {}. Nothing was changed; reload to try again.</p>\
                 <p><a href=\"{}\">back</a></p>",
                esc(key.key()),
                esc(&error.to_string()),
                list_url(&base)
            );
            return html(StatusCode::SERVICE_UNAVAILABLE, "The store failed", &body);
        }
        Err(error) => {
            // A row that cannot be read is kept for an operator: say what is wrong with it,
            // and let it be removed.
            let body = format!(
                "<p><a href=\"{}\">← awaiting reconciliation</a></p><h1>Key {}</h1>\
                 <p class=\"warn\" id=\"error\">This record cannot be read: {}</p>\
                 <form id=\"remove\" method=\"post\" action=\"{base}/remove\">\
                 <input type=\"hidden\" name=\"ref\" value=\"{}\">\
                 <input type=\"hidden\" name=\"state\" value=\"{UNREADABLE}\">\
                 <label>Reason (required) <input name=\"reason\" required size=\"60\"></label>\
                 <button type=\"submit\">Remove this record</button></form>",
                list_url(&base),
                esc(key.key()),
                esc(&error.to_string()),
                esc(&key_ref(&key)),
            );
            return html(StatusCode::OK, "Unreadable record", &body);
        }
    };
    let mut out = String::new();
    let _ = write!(
        out,
        "<p><a href=\"{}\">← awaiting reconciliation</a></p><h1>Key {}</h1>\
         <table id=\"record\"><tr><th>scope</th><td>{}</td></tr>\
         <tr><th>status</th><td id=\"status\">{}</td></tr><tr><th>attempts</th><td>{}</td></tr>\
         <tr><th>effect started</th><td>{}</td></tr><tr><th>downstream id</th><td>{}</td></tr>\
         <tr><th>downstream key</th><td>{}</td></tr><tr><th>fingerprint</th><td>{}</td></tr>\
         <tr><th>resolution note</th><td id=\"note\">{}</td></tr></table>",
        list_url(&base),
        esc(record.key.key()),
        esc(record.key.scope()),
        record.status.as_str(),
        record.attempts,
        record.effect_started,
        esc(record.downstream_id.as_deref().unwrap_or("")),
        esc(&downstream_key(&record.key)),
        hex(record.fingerprint.as_bytes()),
        esc(record.resolution_note.as_deref().unwrap_or("")),
    );
    out.push_str(
        "<h2>History</h2><table id=\"history\"><tr><th>attempt</th><th>attempt id</th>\
         <th>at (ms)</th><th>event</th><th>reason</th></tr>",
    );
    let resolved_at = last_resolution(&record);
    for (i, h) in record.history.iter().enumerate() {
        let note = match Some(i) == resolved_at {
            true => record.resolution_note.as_deref().unwrap_or(""),
            false => "",
        };
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"reason\">{}</td></tr>",
            h.attempt,
            hex(&h.token.get().to_be_bytes()),
            millis(h.at),
            h.event.as_str(),
            esc(note)
        );
    }
    out.push_str("</table><h2>Stored response</h2>");
    match &record.response {
        Some(response) => {
            let _ = write!(
                out,
                "<p>Status {}</p><pre id=\"headers\">",
                response.status.as_u16()
            );
            for (name, value) in &response.headers {
                let _ = writeln!(
                    out,
                    "{}: {}",
                    esc(name.as_str()),
                    esc(&String::from_utf8_lossy(value.as_bytes()))
                );
            }
            out.push_str("</pre>");
            match response.body.as_ref().map(|b| std::str::from_utf8(b)) {
                Some(Ok(text)) => {
                    let _ = write!(out, "<pre id=\"body\">{}</pre>", esc(text));
                }
                Some(Err(_)) => {
                    let len = response.body.as_ref().map_or(0, Bytes::len);
                    let _ = write!(out, "<p>binary body, {len} bytes</p>");
                }
                None => out.push_str("<p>no body recorded</p>"),
            }
        }
        None => out.push_str("<p>none</p>"),
    }
    // The key as a reference a browser sends back intact, and the attempt this page shows:
    // a resolution made here cannot settle a later attempt.
    // The attempt the page shows, and its state: a record settled under the same token since
    // (its recorder's write landed, its holder completed) has moved on all the same.
    let hidden = format!(
        "<input type=\"hidden\" name=\"ref\" value=\"{}\">\
         <input type=\"hidden\" name=\"token\" value=\"{}\">\
         <input type=\"hidden\" name=\"state\" value=\"{}\">",
        esc(&key_ref(&record.key)),
        record.lease_token.get(),
        record.status.as_str()
    );
    // A holder under a live lease cannot be overruled (the store refuses): no forms to fail.
    let held = record.status == crate::store::RecordStatus::InProgress
        && record.lease_until > SystemTime::now();
    if held {
        let _ = write!(
            out,
            "<p id=\"held\">A holder runs this key under a lease until {} (ms since the \
             epoch): it can be resolved by hand once that lease has run out.</p>",
            millis(record.lease_until)
        );
    } else if record.status == crate::store::RecordStatus::NeedsReconciliation
        || record.status == crate::store::RecordStatus::InProgress
    {
        let _ = write!(
            out,
            "<h2>Resolve by hand</h2>\
             <form id=\"resolve-applied\" method=\"post\" action=\"{base}/resolve\">{hidden}\
             <input type=\"hidden\" name=\"outcome\" value=\"applied\">\
             <strong>It happened</strong>: retries get this response.\
             <label>Status <input name=\"status\" value=\"200\" size=\"4\"></label>\
             <label>Content-Type <input name=\"content_type\" value=\"application/json\"></label>\
             <label>Body <textarea name=\"body\" rows=\"4\" cols=\"60\"></textarea></label>\
             <label>Reason (required) <input name=\"reason\" required size=\"60\"></label>\
             <button type=\"submit\">Resolve as applied</button></form>\
             <form id=\"resolve-not-applied\" method=\"post\" action=\"{base}/resolve\">{hidden}\
             <input type=\"hidden\" name=\"outcome\" value=\"not_applied\">\
             <strong>It did not happen</strong>: the next retry runs it.\
             <label>Reason (required) <input name=\"reason\" required size=\"60\"></label>\
             <button type=\"submit\">Resolve as not applied</button></form>"
        );
    }
    let _ = write!(
        out,
        "<form id=\"remove\" method=\"post\" action=\"{base}/remove\">{hidden}\
         <label>Reason (required) <input name=\"reason\" required size=\"60\"></label>\
         <button type=\"submit\">Remove this record</button> (its next request runs as new)</form>"
    );
    html(StatusCode::OK, &format!("Key {}", record.key.key()), &out)
}

/// The fields of a form post, after the same-origin check.
pub(super) async fn form_fields<St>(
    console: &Console<St>,
    req: Request,
) -> Result<Vec<(String, String)>, Response<Body>> {
    if req.method() != Method::POST || !same_origin(&req, &console.origins) {
        return Err(forbidden());
    }
    let (_, body) = read_body(req).await?;
    Ok(form_urlencoded::parse(&body).into_owned().collect())
}

pub(super) fn form_error(base: &str, status: StatusCode, why: &str) -> Response<Body> {
    let body = format!(
        "<h1>Not done</h1><p class=\"warn\" id=\"error\">{}</p><p><a href=\"{}\">back</a></p>",
        esc(why),
        list_url(base)
    );
    html(status, "Not done", &body)
}

pub(super) async fn form_resolve<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    original: OriginalUri,
    req: Request,
) -> Response<Body> {
    let base = base(&original, &req);
    let fields = match form_fields(&console, req).await {
        Ok(fields) => fields,
        Err(res) => return res,
    };
    let settle = match Settle::from_fields(|n| param(&fields, n).map(str::to_owned)) {
        Ok(settle) => settle,
        Err(why) => return form_error(&base, StatusCode::BAD_REQUEST, &why),
    };
    let link = record_link(&base, &settle.key);
    match settle.apply(&console).await {
        Ok(()) => see_other(&link),
        Err(not_done) => form_error(&base, not_done.status(), not_done.why()),
    }
}

pub(super) async fn form_remove<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    original: OriginalUri,
    req: Request,
) -> Response<Body> {
    let base = base(&original, &req);
    let fields = match form_fields(&console, req).await {
        Ok(fields) => fields,
        Err(res) => return res,
    };
    match remove_by_hand(&console, |n| param(&fields, n).map(str::to_owned)).await {
        Ok(true) => see_other(&list_url(&base)),
        Ok(false) => form_error(
            &base,
            StatusCode::NOT_FOUND,
            "no record was removed: there is none for this key",
        ),
        Err((status, why)) => form_error(&base, status, &why),
    }
}

pub(super) async fn form_purge<St: IdempotencyStore>(
    State(console): State<Console<St>>,
    original: OriginalUri,
    req: Request,
) -> Response<Body> {
    let base = base(&original, &req);
    if let Err(res) = form_fields(&console, req).await {
        return res;
    }
    match console.store.purge_expired().await {
        Ok(_) => see_other(&list_url(&base)),
        Err(error) => form_error(&base, StatusCode::SERVICE_UNAVAILABLE, &error.to_string()),
    }
}
