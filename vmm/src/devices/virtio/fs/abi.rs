//! The FUSE wire format (Linux `include/uapi/linux/fuse.h`, protocol 7.38
//! as Linux 6.1 speaks it): the structs this server reads and writes, all
//! little-endian plain data.

use vm_memory::ByteValued;

/// The protocol's major version; a kernel with another major is refused.
pub const KERNEL_VERSION: u32 = 7;
/// The newest minor version this server speaks.
pub const KERNEL_MINOR_VERSION: u32 = 38;
/// The share's root directory.
pub const ROOT_ID: u64 = 1;

/// Opcodes (`enum fuse_opcode`).
pub mod op {
    pub const LOOKUP: u32 = 1;
    pub const FORGET: u32 = 2;
    pub const GETATTR: u32 = 3;
    pub const SETATTR: u32 = 4;
    pub const READLINK: u32 = 5;
    pub const SYMLINK: u32 = 6;
    pub const MKNOD: u32 = 8;
    pub const MKDIR: u32 = 9;
    pub const UNLINK: u32 = 10;
    pub const RMDIR: u32 = 11;
    pub const RENAME: u32 = 12;
    pub const LINK: u32 = 13;
    pub const OPEN: u32 = 14;
    pub const READ: u32 = 15;
    pub const WRITE: u32 = 16;
    pub const STATFS: u32 = 17;
    pub const RELEASE: u32 = 18;
    pub const FSYNC: u32 = 20;
    pub const FLUSH: u32 = 25;
    pub const INIT: u32 = 26;
    pub const OPENDIR: u32 = 27;
    pub const READDIR: u32 = 28;
    pub const RELEASEDIR: u32 = 29;
    pub const FSYNCDIR: u32 = 30;
    pub const ACCESS: u32 = 34;
    pub const CREATE: u32 = 35;
    pub const INTERRUPT: u32 = 36;
    pub const DESTROY: u32 = 38;
    pub const BATCH_FORGET: u32 = 42;
    pub const FALLOCATE: u32 = 43;
    pub const RENAME2: u32 = 45;
    pub const LSEEK: u32 = 46;
    pub const SYNCFS: u32 = 50;
}

/// `fuse_init_in.flags` / `fuse_init_out.flags` bits this server uses.
pub mod init {
    pub const ASYNC_READ: u32 = 1 << 0;
    pub const ATOMIC_O_TRUNC: u32 = 1 << 3;
    pub const BIG_WRITES: u32 = 1 << 5;
    pub const PARALLEL_DIROPS: u32 = 1 << 18;
    pub const MAX_PAGES: u32 = 1 << 22;
}

/// `fuse_setattr_in.valid` bits.
pub mod fattr {
    pub const MODE: u32 = 1 << 0;
    pub const UID: u32 = 1 << 1;
    pub const GID: u32 = 1 << 2;
    pub const SIZE: u32 = 1 << 3;
    pub const ATIME: u32 = 1 << 4;
    pub const MTIME: u32 = 1 << 5;
    pub const FH: u32 = 1 << 6;
    pub const ATIME_NOW: u32 = 1 << 7;
    pub const MTIME_NOW: u32 = 1 << 8;
}

macro_rules! wire {
    ($($(#[$doc:meta])* pub struct $name:ident { $(pub $field:ident: $ty:ty,)* })*) => {$(
        $(#[$doc])*
        #[repr(C)]
        #[derive(Debug, Default, Clone, Copy)]
        pub struct $name { $(pub $field: $ty,)* }
        // SAFETY: plain integers (or arrays of them) with no padding
        // (checked by `sizes_match_the_kernel`); every bit pattern is valid.
        unsafe impl ByteValued for $name {}
    )*};
}

wire! {
    /// Every request starts with this.
    pub struct InHeader {
        pub len: u32,
        pub opcode: u32,
        pub unique: u64,
        pub nodeid: u64,
        pub uid: u32,
        pub gid: u32,
        pub pid: u32,
        pub total_extlen: u16,
        pub padding: u16,
    }
    /// Every reply starts with this; `error` is 0 or a negative errno.
    pub struct OutHeader {
        pub len: u32,
        pub error: i32,
        pub unique: u64,
    }
    pub struct Attr {
        pub ino: u64,
        pub size: u64,
        pub blocks: u64,
        pub atime: u64,
        pub mtime: u64,
        pub ctime: u64,
        pub atimensec: u32,
        pub mtimensec: u32,
        pub ctimensec: u32,
        pub mode: u32,
        pub nlink: u32,
        pub uid: u32,
        pub gid: u32,
        pub rdev: u32,
        pub blksize: u32,
        pub flags: u32,
    }
    pub struct EntryOut {
        pub nodeid: u64,
        pub generation: u64,
        pub entry_valid: u64,
        pub attr_valid: u64,
        pub entry_valid_nsec: u32,
        pub attr_valid_nsec: u32,
        pub attr: Attr,
    }
    pub struct AttrOut {
        pub attr_valid: u64,
        pub attr_valid_nsec: u32,
        pub dummy: u32,
        pub attr: Attr,
    }
    pub struct InitIn {
        pub major: u32,
        pub minor: u32,
        pub max_readahead: u32,
        pub flags: u32,
    }
    pub struct InitOut {
        pub major: u32,
        pub minor: u32,
        pub max_readahead: u32,
        pub flags: u32,
        pub max_background: u16,
        pub congestion_threshold: u16,
        pub max_write: u32,
        pub time_gran: u32,
        pub max_pages: u16,
        pub map_alignment: u16,
        pub flags2: u32,
        pub unused: [u32; 7],
    }
    pub struct ForgetIn {
        pub nlookup: u64,
    }
    pub struct ForgetOne {
        pub nodeid: u64,
        pub nlookup: u64,
    }
    pub struct BatchForgetIn {
        pub count: u32,
        pub dummy: u32,
    }
    pub struct SetattrIn {
        pub valid: u32,
        pub padding: u32,
        pub fh: u64,
        pub size: u64,
        pub lock_owner: u64,
        pub atime: u64,
        pub mtime: u64,
        pub ctime: u64,
        pub atimensec: u32,
        pub mtimensec: u32,
        pub ctimensec: u32,
        pub mode: u32,
        pub unused4: u32,
        pub uid: u32,
        pub gid: u32,
        pub unused5: u32,
    }
    pub struct MknodIn {
        pub mode: u32,
        pub rdev: u32,
        pub umask: u32,
        pub padding: u32,
    }
    pub struct MkdirIn {
        pub mode: u32,
        pub umask: u32,
    }
    pub struct RenameIn {
        pub newdir: u64,
    }
    pub struct Rename2In {
        pub newdir: u64,
        pub flags: u32,
        pub padding: u32,
    }
    pub struct LinkIn {
        pub oldnodeid: u64,
    }
    pub struct OpenIn {
        pub flags: u32,
        pub open_flags: u32,
    }
    pub struct CreateIn {
        pub flags: u32,
        pub mode: u32,
        pub umask: u32,
        pub open_flags: u32,
    }
    pub struct OpenOut {
        pub fh: u64,
        pub open_flags: u32,
        pub padding: u32,
    }
    pub struct ReleaseIn {
        pub fh: u64,
        pub flags: u32,
        pub release_flags: u32,
        pub lock_owner: u64,
    }
    pub struct ReadIn {
        pub fh: u64,
        pub offset: u64,
        pub size: u32,
        pub read_flags: u32,
        pub lock_owner: u64,
        pub flags: u32,
        pub padding: u32,
    }
    pub struct WriteIn {
        pub fh: u64,
        pub offset: u64,
        pub size: u32,
        pub write_flags: u32,
        pub lock_owner: u64,
        pub flags: u32,
        pub padding: u32,
    }
    pub struct WriteOut {
        pub size: u32,
        pub padding: u32,
    }
    pub struct Kstatfs {
        pub blocks: u64,
        pub bfree: u64,
        pub bavail: u64,
        pub files: u64,
        pub ffree: u64,
        pub bsize: u32,
        pub namelen: u32,
        pub frsize: u32,
        pub padding: u32,
        pub spare: [u32; 6],
    }
    pub struct FsyncIn {
        pub fh: u64,
        pub fsync_flags: u32,
        pub padding: u32,
    }
    pub struct FallocateIn {
        pub fh: u64,
        pub offset: u64,
        pub length: u64,
        pub mode: u32,
        pub padding: u32,
    }
    pub struct LseekIn {
        pub fh: u64,
        pub offset: u64,
        pub whence: u32,
        pub padding: u32,
    }
    pub struct LseekOut {
        pub offset: u64,
    }
    /// A directory entry's fixed part; its name follows, padded to 8 bytes.
    pub struct Dirent {
        pub ino: u64,
        pub off: u64,
        pub namelen: u32,
        pub typ: u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::size_of;

    #[test]
    fn sizes_match_the_kernel() {
        // The sizes fuse.h's structs have (and so no padding here).
        assert_eq!(size_of::<InHeader>(), 40);
        assert_eq!(size_of::<OutHeader>(), 16);
        assert_eq!(size_of::<Attr>(), 88);
        assert_eq!(size_of::<EntryOut>(), 128);
        assert_eq!(size_of::<AttrOut>(), 104);
        assert_eq!(size_of::<InitIn>(), 16);
        assert_eq!(size_of::<InitOut>(), 64);
        assert_eq!(size_of::<SetattrIn>(), 88);
        assert_eq!(size_of::<OpenOut>(), 16);
        assert_eq!(size_of::<ReadIn>(), 40);
        assert_eq!(size_of::<WriteIn>(), 40);
        assert_eq!(size_of::<Kstatfs>(), 80);
        assert_eq!(size_of::<Dirent>(), 24);
        assert_eq!(size_of::<ReleaseIn>(), 24);
        assert_eq!(size_of::<CreateIn>(), 16);
        assert_eq!(size_of::<FallocateIn>(), 32);
        assert_eq!(size_of::<LseekIn>(), 24);
    }
}
