//! Row sources with random access: HF `datasets` save_to_disk folders (Arrow IPC *stream*
//! shards listed in `state.json`), DatasetDict folders (a split picked by `dir:split` or
//! `data.split`), single `.arrow` files (stream or file format), `.parquet` and `.jsonl`
//! files, folders of them (one split when the file names say splits), or a list of any of
//! these, read one after another.
//!
//! Every shard is cut into blocks at open without decoding data: Arrow IPC files are
//! memory-mapped and their message framing scanned (record batches); Parquet files expose
//! their row groups from the footer; JSONL files are scanned once for line offsets (one block
//! per 1024 lines; a UTF-8 byte-order mark is skipped, and a line that is not a JSON object is
//! a bad record named by its line number). A block is decoded only when one of its rows is
//! needed, and only one is kept. So memory stays at one block however large the data, and a
//! saved [`Cursor`] is reached directly on resume without reading what came before.
//!
//! Files: `split` (which files an entry means), `shards` (a shard of any format and its
//! blocks) over `ipc_shard`, `parquet_shard` and `jsonl_shard`, `rows` (the rows in order,
//! by position) and `cells` (reading a row's cells).

mod cells;
mod ipc_shard;
mod jsonl_shard;
mod parquet_shard;
mod rows;
mod shards;
mod split;
use ipc_shard::*;
use jsonl_shard::*;
use parquet_shard::*;
pub use rows::*;
pub use shards::*;
pub use split::*;
