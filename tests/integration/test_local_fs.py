"""The test session's Spark uses Hadoop's local file system without child processes, and it does what
Hadoop's own does: permissions, file status, symbolic links (every Delta and checkpoint test writes through it)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from py4j.protocol import Py4JJavaError

from iotmon import local_fs

pytestmark = pytest.mark.integration


def test_the_session_writes_local_files_without_processes_and_as_hadoop_would(spark, tmp_path: Path) -> None:
    jvm = spark.sparkContext._jvm
    hadoop = jvm.org.apache.hadoop.fs
    conf = spark.sparkContext._jsc.hadoopConfiguration()
    fs = hadoop.FileSystem.getLocal(conf)
    context = hadoop.FileContext.getLocalFSFileContext(conf)
    assert fs.getClass().getName() == local_fs.FILE_SYSTEM, "is `iotmon setup` (a JDK's javac) done?"
    assert context.getDefaultFileSystem().getClass().getName() == local_fs.ABSTRACT_FILE_SYSTEM

    # Permissions, which Hadoop's own sets with a `chmod` process.
    file, directory = tmp_path / "file", tmp_path / "directory"
    fs.create(hadoop.Path(str(file)), True).close()
    fs.setPermission(hadoop.Path(str(file)), hadoop.permission.FsPermission("640"))
    assert stat.S_IMODE(file.stat().st_mode) == 0o640
    assert fs.mkdirs(hadoop.Path(str(directory)), hadoop.permission.FsPermission("750"))
    fs.setPermission(hadoop.Path(str(directory)), hadoop.permission.FsPermission("705"))
    assert stat.S_IMODE(directory.stat().st_mode) == 0o705
    assert fs.getFileStatus(hadoop.Path(str(file))).getPermission().toString() == "rw-r-----"
    with pytest.raises(Py4JJavaError, match="FileNotFoundException"):
        fs.setPermission(hadoop.Path(str(tmp_path / "missing")), hadoop.permission.FsPermission("600"))

    # A file's own status, which Hadoop's own reads with a `readlink` process; a link's still says it is one.
    link = tmp_path / "link"
    os.symlink(file, link)
    plain = context.getFileLinkStatus(hadoop.Path(str(file)))
    assert plain.isFile() and not plain.isSymlink() and plain.getLen() == 0
    linked = context.getFileLinkStatus(hadoop.Path(str(link)))
    assert linked.isSymlink() and Path(linked.getSymlink().toUri().getPath()) == file
    with pytest.raises(Py4JJavaError, match="FileNotFoundException"):
        context.getFileLinkStatus(hadoop.Path(str(tmp_path / "missing")))

    # A FileContext rename, as Delta's log store commits: a temporary file renamed over nothing.
    gateway = spark.sparkContext._gateway
    temporary, final = tmp_path / ".commit.tmp", tmp_path / "00000.json"
    flags = jvm.java.util.EnumSet.of(hadoop.CreateFlag.CREATE)
    stream = context.create(hadoop.Path(str(temporary)), flags, gateway.new_array(hadoop.Options.CreateOpts, 0))
    stream.write(b"{}")
    stream.close()
    context.rename(hadoop.Path(str(temporary)), hadoop.Path(str(final)), gateway.new_array(hadoop.Options.Rename, 0))
    assert final.read_bytes() == b"{}" and not temporary.exists()
