//! Reading a row's cells as text, token ids or JSON values, whatever the column's Arrow type.
use super::{Row, RowRef};
use crate::error::{Error, Result};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int16Type, Int32Type, Int64Type, Int8Type, UInt16Type, UInt32Type, UInt64Type, UInt8Type};
use arrow_array::Array;

/// Said where messages have ShareGPT's keys instead of `role` and `content`.
const SHAREGPT: &str = " (they have `from` and `value`, ShareGPT's layout: convert them to `role` and `content` with the roles system, user and assistant, the layout transformers' chat templates and TRL read)";

impl RowRef<'_> {
    /// "row N" (N counted in the row's own file, which messages name with it: across a list
    /// of sources or a folder's shards a dataset-wide count pointed at the wrong row), with the
    /// file's line number for JSON lines: "row N (line L)".
    pub fn at(&self) -> String {
        format!("row {}", self.number())
    }

    /// [`Self::at`] without the word "row": "N" or "N (line L)".
    pub fn number(&self) -> String {
        match &self.row {
            Row::Json { line, .. } | Row::BadLine { line, .. } => format!("{} (line {line})", self.file_row),
            Row::Arrow { .. } => self.file_row.to_string(),
        }
    }

    fn err(&self, column: &str, msg: impl std::fmt::Display) -> Error {
        Error::data(self.file, format!("{}: column `{column}`: {msg}", self.at()))
    }

    /// A JSON line that holds no record: why, naming the row and line.
    pub fn bad_line(&self) -> Option<String> {
        match &self.row {
            Row::BadLine { msg, .. } => Some(format!("{}: {msg}", self.at())),
            _ => None,
        }
    }

    /// The error for reading any cell of a line that holds no record (rather than reading it
    /// as empty cells).
    fn bad_line_err(&self) -> Error {
        Error::data(self.file, self.bad_line().unwrap_or_else(|| self.at()))
    }

    pub fn has(&self, column: &str) -> bool {
        match &self.row {
            Row::Arrow { batch, .. } => batch.column_by_name(column).is_some(),
            Row::Json { fields, .. } => fields.get(column).is_some(),
            Row::BadLine { .. } => false,
        }
    }

    /// The cell of an Arrow column of JSON text (`arrow.json`, see [`holds_json_text`]),
    /// parsed; `None` for a JSON line or a column of any other type.
    fn json_text_cell(&self, column: &str) -> Result<Option<serde_json::Value>> {
        let Row::Arrow { batch, row } = &self.row else { return Ok(None) };
        let schema = batch.schema();
        let Some((i, _)) = schema.column_with_name(column).filter(|(_, f)| holds_json_text(f)) else { return Ok(None) };
        arrow_json_value(batch.column(i).as_ref(), true, *row).map(Some).map_err(|t| self.err(column, format!("holds {t}")))
    }

    /// An integer list cell (`list<int*>`, `large_list<int*>`, or a JSON array of integers).
    pub fn int_list(&self, column: &str) -> Result<Vec<i64>> {
        if let Some(v) = self.json_text_cell(column)? {
            return self.int_list_from_json(column, Some(&v));
        }
        match &self.row {
            Row::BadLine { .. } => Err(self.bad_line_err()),
            Row::Json { fields, .. } => self.int_list_from_json(column, fields.get(column)),
            Row::Arrow { batch, row } => {
                let col = batch.column_by_name(column).ok_or_else(|| self.err(column, "missing"))?;
                if null_at(col.as_ref(), *row) {
                    return Err(self.err(column, "is null"));
                }
                let values = list_cell(col, *row)
                    .ok_or_else(|| self.err(column, format!("expected a list of integers, got {}", col.data_type())))?;
                // `values()` of a primitive array reads a null slot as whatever its buffer
                // holds (usually 0): a null must not become a token id.
                if values.null_count() > 0 {
                    return Err(self.err(column, format!("holds {} null value(s); expected integers", values.null_count())));
                }
                macro_rules! ints {
                    ($($t:ty),*) => {
                        $( if let Some(p) = values.as_primitive_opt::<$t>() {
                            return Ok(p.values().iter().map(|&v| v as i64).collect());
                        } )*
                    };
                }
                ints!(Int32Type, Int64Type, UInt32Type, Int16Type, UInt16Type, Int8Type, UInt8Type);
                if let Some(p) = values.as_primitive_opt::<UInt64Type>() {
                    return p.values().iter().map(|&v| i64::try_from(v).map_err(|_| self.err(column, format!("value {v} out of range")))).collect();
                }
                Err(self.err(column, format!("expected integer elements, got {}", values.data_type())))
            }
        }
    }

    fn int_list_from_json(&self, column: &str, v: Option<&serde_json::Value>) -> Result<Vec<i64>> {
        let a = v.ok_or_else(|| self.err(column, "missing"))?;
        let a = a.as_array().ok_or_else(|| self.err(column, format!("expected a list of integers, got {a}")))?;
        a.iter().map(|x| x.as_i64().ok_or_else(|| self.err(column, format!("expected integers, got {x}")))).collect()
    }

    /// Any cell as JSON (an Arrow struct as an object, a list as an array); `None` when the
    /// column is absent or the cell is null.
    pub fn json(&self, column: &str) -> Result<Option<serde_json::Value>> {
        match &self.row {
            Row::BadLine { .. } => Err(self.bad_line_err()),
            Row::Json { fields, .. } => Ok(fields.get(column).filter(|v| !v.is_null()).cloned()),
            Row::Arrow { batch, row } => {
                let schema = batch.schema();
                let Some((i, f)) = schema.column_with_name(column) else { return Ok(None) };
                let v = arrow_json_value(batch.column(i).as_ref(), holds_json_text(f), *row)
                    .map_err(|t| self.err(column, format!("holds {t}, which has no JSON form")))?;
                Ok(Some(v).filter(|v| !v.is_null()))
            }
        }
    }

    /// A string cell; `None` when the column is absent or the cell is null.
    pub fn string(&self, column: &str) -> Result<Option<String>> {
        if let Some(v) = self.json_text_cell(column)? {
            return self.string_from_json(column, Some(&v));
        }
        match &self.row {
            Row::BadLine { .. } => Err(self.bad_line_err()),
            Row::Json { fields, .. } => self.string_from_json(column, fields.get(column)),
            Row::Arrow { batch, row } => {
                let Some(col) = batch.column_by_name(column) else { return Ok(None) };
                if null_at(col.as_ref(), *row) {
                    return Ok(None);
                }
                match text_cell(col.as_ref(), *row) {
                    Some(s) => Ok(Some(s)),
                    None => Err(self.err(column, format!("expected a string, got {}", col.data_type()))),
                }
            }
        }
    }

    fn string_from_json(&self, column: &str, v: Option<&serde_json::Value>) -> Result<Option<String>> {
        match v {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => Err(self.err(column, format!("expected a string, got {other}"))),
        }
    }

    /// A string cell that must be there: an error naming the file, row and column when the
    /// column is absent or the cell null (where reading it as "" would silently change what
    /// the row says, e.g. an expected answer in `finetune eval`).
    pub fn required_string(&self, column: &str) -> Result<String> {
        self.string(column)?.ok_or_else(|| self.err(column, "is missing or null"))
    }

    /// A list of {role, content} messages (`list<struct<role, content>>` or a JSON array).
    /// An Arrow cell is read as the JSON value `datasets` would hand Python (every message
    /// with every key any message has, null where it has none), so both read alike.
    pub fn messages(&self, column: &str) -> Result<Option<Vec<crate::chat::Message>>> {
        use crate::chat::Message;
        let cell = match &self.row {
            Row::BadLine { .. } => return Err(self.bad_line_err()),
            Row::Json { fields, .. } => fields.get(column).cloned(),
            Row::Arrow { batch, row } => {
                let schema = batch.schema();
                let Some((i, f)) = schema.column_with_name(column) else { return Ok(None) };
                let json = holds_json_text(f);
                let col = batch.column(i);
                if !json && !null_at(col.as_ref(), *row) && list_cell(col, *row).is_none() {
                    return Err(self.err(column, format!("expected a list of {{role, content}} structs, got {}", col.data_type())));
                }
                Some(arrow_json_value(col.as_ref(), json, *row).map_err(|t| self.err(column, format!("a message holds {t}, which a chat template cannot read")))?)
            }
        };
        match cell {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|m| {
                    let role = m.get("role").and_then(|r| r.as_str()).ok_or_else(|| {
                        let sharegpt = m.get("from").is_some() && m.get("value").is_some();
                        self.err(column, format!("a message has no string `role`{}", if sharegpt { SHAREGPT } else { "" }))
                    })?;
                    let mut msg = match m.get("content") {
                        Some(serde_json::Value::String(c)) => Message::new(role, c),
                        // A tool-call turn: the template decides what None renders as.
                        Some(serde_json::Value::Null) if role == "assistant" => Message::without_content(role),
                        _ => return Err(self.err(column, "a message has no string `content` (only an assistant turn's may be null)")),
                    };
                    if let Some(o) = m.as_object() {
                        msg.extra.extend(o.iter().filter(|(k, _)| *k != "role" && *k != "content").map(|(k, v)| (k.clone(), v.clone())));
                    }
                    Ok(msg)
                })
                .collect::<Result<Vec<_>>>()
                .map(Some),
            Some(other) => Err(self.err(column, format!("expected a list of messages, got {other}"))),
        }
    }
}

/// Whether an Arrow field holds JSON text: the canonical `arrow.json` extension type, as
/// `datasets` 5 stores a `Json` feature (what `load_dataset("json")` infers for a field whose
/// shape differs between records: tool-call arguments, tool schemas, messages with different
/// keys) in `save_to_disk` and Parquet files, and as a Parquet column of the JSON logical type
/// reads. Its cells are JSON documents to parse, never strings to hand a template.
fn holds_json_text(f: &arrow_schema::Field) -> bool {
    f.metadata().get("ARROW:extension:name").is_some_and(|n| n == "arrow.json")
}

/// Whether element `i` is null. A column of Arrow's null type (what `datasets` types a column
/// that is None in every record, e.g. an alpaca `input` never given) is null everywhere, though
/// arrow's `is_null` says false for it (it has no validity buffer).
fn null_at(a: &dyn Array, i: usize) -> bool {
    a.data_type() == &arrow_schema::DataType::Null || a.is_null(i)
}

/// Element `i` (not null) of a string array: utf8, large_utf8, utf8_view, or a dictionary of
/// those (what a Parquet file of categorical or dictionary-typed columns reads as); None for
/// any other type.
fn text_cell(a: &dyn Array, i: usize) -> Option<String> {
    use arrow_schema::DataType as T;
    match a.data_type() {
        T::Utf8 => Some(a.as_string::<i32>().value(i).to_string()),
        T::LargeUtf8 => Some(a.as_string::<i64>().value(i).to_string()),
        T::Utf8View => Some(a.as_string_view().value(i).to_string()),
        T::Dictionary(_, v) if matches!(**v, T::Utf8 | T::LargeUtf8 | T::Utf8View) => {
            let one = arrow_cast::cast(&a.slice(i, 1), &T::Utf8).ok()?;
            Some(one.as_string::<i32>().value(0).to_string())
        }
        _ => None,
    }
}

/// Element `i` of an Arrow array as the JSON value `datasets` would hand a template in
/// Python (strings, numbers, booleans, lists and structs, null; other types as text).
/// `json`: the array holds JSON text ([`holds_json_text`]), parsed here.
fn arrow_json_value(a: &dyn Array, json: bool, i: usize) -> std::result::Result<serde_json::Value, String> {
    use arrow_array::types::{Float32Type, Float64Type};
    use arrow_schema::DataType as T;
    use serde_json::Value as V;
    if null_at(a, i) {
        return Ok(V::Null);
    }
    if let Some(t) = text_cell(a, i) {
        return match json {
            true => serde_json::from_str(&t).map_err(|e| format!("arrow.json text that is not JSON ({e})")),
            false => Ok(V::String(t)),
        };
    }
    macro_rules! num {
        ($t:ty) => {
            serde_json::json!(a.as_primitive::<$t>().value(i))
        };
    }
    Ok(match a.data_type() {
        T::Null => V::Null,
        T::Boolean => V::Bool(a.as_boolean().value(i)),
        T::Int8 => num!(Int8Type),
        T::Int16 => num!(Int16Type),
        T::Int32 => num!(Int32Type),
        T::Int64 => num!(Int64Type),
        T::UInt8 => num!(UInt8Type),
        T::UInt16 => num!(UInt16Type),
        T::UInt32 => num!(UInt32Type),
        T::UInt64 => num!(UInt64Type),
        T::Float32 => num!(Float32Type),
        T::Float64 => num!(Float64Type),
        T::List(f) | T::LargeList(f) => {
            let l: arrow_array::ArrayRef = if let Some(l) = a.as_list_opt::<i32>() { l.value(i) } else { a.as_list::<i64>().value(i) };
            V::Array((0..l.len()).map(|j| arrow_json_value(l.as_ref(), holds_json_text(f), j)).collect::<std::result::Result<_, _>>()?)
        }
        T::Struct(_) => {
            let st = a.as_struct();
            let mut o = serde_json::Map::new();
            for (f, c) in st.fields().iter().zip(st.columns()) {
                o.insert(f.name().clone(), arrow_json_value(c.as_ref(), holds_json_text(f), i)?);
            }
            V::Object(o)
        }
        // Anything else (timestamps, decimals, binary, ...) as arrow prints it: what a
        // template would print of the Python value, near enough, and never a reason to
        // refuse a record whose template does not read it.
        _ => {
            let f = arrow_cast::display::ArrayFormatter::try_new(a, &arrow_cast::display::FormatOptions::default()).map_err(|e| e.to_string())?;
            V::String(f.value(i).to_string())
        }
    })
}

/// The values of a `list` / `large_list` cell.
fn list_cell(col: &arrow_array::ArrayRef, row: usize) -> Option<arrow_array::ArrayRef> {
    if let Some(l) = col.as_list_opt::<i32>() {
        Some(l.value(row))
    } else {
        col.as_list_opt::<i64>().map(|l| l.value(row))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn message_fields_of_other_arrow_types_reach_the_template_as_text() {
        let ts = arrow_array::TimestampMillisecondArray::from(vec![Some(86_400_000), None]);
        assert_eq!(super::arrow_json_value(&ts, false, 0).unwrap(), serde_json::json!("1970-01-02T00:00:00"));
        assert_eq!(super::arrow_json_value(&ts, false, 1).unwrap(), serde_json::Value::Null);
        let n = arrow_array::Int32Array::from(vec![7]);
        assert_eq!(super::arrow_json_value(&n, false, 0).unwrap(), serde_json::json!(7));
    }
}
