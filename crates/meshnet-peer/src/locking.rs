//! The poison-tolerant lock every module of the crate takes its mutexes with.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks a mutex, taking the data of a poisoned one (a panicked holder leaves it usable).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
