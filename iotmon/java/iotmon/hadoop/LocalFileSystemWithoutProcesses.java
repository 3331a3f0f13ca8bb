package iotmon.hadoop;

import org.apache.hadoop.fs.LocalFileSystem;

/** {@code fs.file.impl}: the checksummed local file system of {@code FileSystem}, over the raw one without processes. */
public class LocalFileSystemWithoutProcesses extends LocalFileSystem {
  public LocalFileSystemWithoutProcesses() {
    super(new RawLocalFileSystemWithoutProcesses());
  }
}
