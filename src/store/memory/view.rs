//! Each thread's own references to the tables of the stores it decided on last, so that finding
//! a table costs it no write to memory another thread uses.

use std::cell::RefCell;
use std::sync::atomic::AtomicU64;

use super::Inner;
use super::shard::lock;
use super::table::Table;

/// How many stores a thread keeps its view of the tables for.
pub(super) const STORES_PER_THREAD: usize = 4;

/// Gives every store an identity that no later store reuses, for the threads' views of tables.
pub(super) static NEXT_STORE: AtomicU64 = AtomicU64::new(1);

/// A thread's references to the tables of one store.
pub(super) struct View {
    pub(super) store: u64,
    pub(super) tables: Box<[Table]>,
}

thread_local! {
    /// This thread's views of the stores it decided on last, the latest first.
    pub(super) static VIEWS: RefCell<Vec<View>> = const { RefCell::new(Vec::new()) };
}

impl Inner {
    /// This thread's view of every shard's table, made on the thread's first decision on this
    /// store.
    #[inline]
    pub(super) fn view<'a>(&self, views: &'a mut Vec<View>) -> &'a mut [Table] {
        // Split so that the usual case, the thread's latest store, is inlined into decisions.
        if views.first().is_some_and(|v| v.store == self.id) {
            return match views.first_mut() {
                Some(view) => &mut view.tables,
                None => &mut [],
            };
        }
        self.other_view(views)
    }

    #[cold]
    fn other_view<'a>(&self, views: &'a mut Vec<View>) -> &'a mut [Table] {
        match views.iter().position(|v| v.store == self.id) {
            Some(0) => {}
            Some(at) => views[..=at].rotate_right(1),
            None => {
                let tables = self
                    .shards
                    .iter()
                    .map(|s| lock(&s.0).table.clone())
                    .collect();
                views.insert(
                    0,
                    View {
                        store: self.id,
                        tables,
                    },
                );
                views.truncate(STORES_PER_THREAD);
            }
        }
        match views.first_mut() {
            Some(view) => &mut view.tables,
            // Just placed at the front.
            None => &mut [],
        }
    }
}

/// Points this thread's view of shard `index` at `table`, so that it holds no reference to the
/// table just replaced.
pub(super) fn refresh_view(inner: &Inner, index: usize, table: &Table) {
    let _ = VIEWS.try_with(|views| {
        if let Ok(mut views) = views.try_borrow_mut()
            && let Some(mine) = inner.view(&mut views).get_mut(index)
        {
            *mine = table.clone();
        }
    });
}
