package iotmon.hadoop;

import java.io.FileNotFoundException;
import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.LinkOption;
import java.nio.file.attribute.PosixFilePermission;
import java.util.EnumSet;
import java.util.Set;
import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.Path;
import org.apache.hadoop.fs.RawLocalFileSystem;
import org.apache.hadoop.fs.permission.FsAction;
import org.apache.hadoop.fs.permission.FsPermission;
import org.apache.hadoop.io.nativeio.NativeIO;

/**
 * Hadoop's local file system, minus the processes it starts without its native library (which Maven Central
 * does not ship): a {@code chmod} for every file it creates and a {@code readlink} for every file status a
 * {@code FileContext} rename asks for. The JDK does both in-process. Everything else is Hadoop's own, and so is
 * everything when the native library is loaded.
 */
public class RawLocalFileSystemWithoutProcesses extends RawLocalFileSystem {

  /** The permission bits, set through the JDK instead of a {@code chmod} process. */
  @Override
  public void setPermission(Path path, FsPermission permission) throws IOException {
    if (NativeIO.isAvailable()) {
      super.setPermission(path, permission);
      return;
    }
    java.nio.file.Path file = pathToFile(path).toPath();
    if (!Files.exists(file, LinkOption.NOFOLLOW_LINKS)) {
      throw new FileNotFoundException("File " + path + " does not exist");
    }
    Files.setPosixFilePermissions(file, posix(permission));
  }

  /** A symbolic link's own status needs {@code readlink}; anything else's is its plain file status. */
  @Override
  public FileStatus getFileLinkStatus(Path path) throws IOException {
    if (NativeIO.isAvailable() || Files.isSymbolicLink(pathToFile(path).toPath())) {
      return super.getFileLinkStatus(path);
    }
    return getFileStatus(path);
  }

  /** The read, write and execute bits of user, group and others (what {@code chmod} with Hadoop's octal sets). */
  static Set<PosixFilePermission> posix(FsPermission permission) {
    Set<PosixFilePermission> bits = EnumSet.noneOf(PosixFilePermission.class);
    add(bits, permission.getUserAction(),
        PosixFilePermission.OWNER_READ, PosixFilePermission.OWNER_WRITE, PosixFilePermission.OWNER_EXECUTE);
    add(bits, permission.getGroupAction(),
        PosixFilePermission.GROUP_READ, PosixFilePermission.GROUP_WRITE, PosixFilePermission.GROUP_EXECUTE);
    add(bits, permission.getOtherAction(),
        PosixFilePermission.OTHERS_READ, PosixFilePermission.OTHERS_WRITE, PosixFilePermission.OTHERS_EXECUTE);
    return bits;
  }

  private static void add(
      Set<PosixFilePermission> bits, FsAction action,
      PosixFilePermission read, PosixFilePermission write, PosixFilePermission execute) {
    if (action.implies(FsAction.READ)) {
      bits.add(read);
    }
    if (action.implies(FsAction.WRITE)) {
      bits.add(write);
    }
    if (action.implies(FsAction.EXECUTE)) {
      bits.add(execute);
    }
  }
}
