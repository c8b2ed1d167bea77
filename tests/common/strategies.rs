//! proptest strategies (filled in below).
