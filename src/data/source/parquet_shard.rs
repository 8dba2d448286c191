//! Parquet shards: one block per row group.
use super::guarded;
use crate::error::{Error, Result};
use arrow_array::RecordBatch;
use std::path::{Path, PathBuf};

/// A Parquet file: one block per row group.
pub(super) struct ParquetShard {
    pub(super) path: PathBuf,
    pub(super) groups: Vec<usize>,
    /// The schema's top-level column names.
    pub(super) columns: Vec<String>,
}

impl ParquetShard {
    pub(super) fn open(path: &Path) -> Result<Self> {
        use parquet::file::reader::{FileReader, SerializedFileReader};
        let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let (groups, columns) = guarded(path, "Parquet footer", || {
            let r = SerializedFileReader::new(f).map_err(|e| Error::data(path, format!("not a readable Parquet file: {e}")))?;
            let m = r.metadata();
            let columns = m.file_metadata().schema_descr().root_schema().get_fields().iter().map(|f| f.name().to_string()).collect();
            Ok((m.row_groups().iter().map(|g| g.num_rows().max(0) as usize).collect(), columns))
        })?;
        Ok(ParquetShard { path: path.to_path_buf(), groups, columns })
    }

    pub(super) fn decode(&self, group: usize) -> Result<RecordBatch> {
        guarded(&self.path, &format!("row group {group}"), || self.decode_unguarded(group))
    }

    fn decode_unguarded(&self, group: usize) -> Result<RecordBatch> {
        use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
        let bad = |e: String| Error::data(&self.path, format!("row group {group}: {e}"));
        let f = std::fs::File::open(&self.path).map_err(|e| Error::io(&self.path, e))?;
        let reader = ParquetRecordBatchReaderBuilder::try_new(f)
            .map_err(|e| bad(e.to_string()))?
            .with_row_groups(vec![group])
            .with_batch_size(self.groups[group].max(1))
            .build()
            .map_err(|e| bad(e.to_string()))?;
        let batches: Vec<RecordBatch> = reader.collect::<std::result::Result<_, _>>().map_err(|e| bad(e.to_string()))?;
        let schema = batches.first().map(|b| b.schema()).ok_or_else(|| bad("empty".into()))?;
        arrow_select::concat::concat_batches(&schema, &batches).map_err(|e| bad(e.to_string()))
    }
}
