#![doc = "Crate docs are written below."]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod bucket;
mod clock;
mod key;
mod limit;
mod store;

pub use clock::{Clock, ManualClock, SystemClock, TokioClock};
pub use key::{BucketKey, InvalidKey};
pub use limit::{InvalidLimit, Limit};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use store::RedisStore;
pub use store::{
    BackendError, BoxFuture, BucketStore, Decision, DynBucketStore, MemoryStore, Quota, StoreError,
};
