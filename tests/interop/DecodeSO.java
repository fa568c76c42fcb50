// Decodes Avro single-object files with Apache Avro Java's BinaryMessageDecoder (header,
// fingerprint lookup and schema resolution all Apache's), reader schema = the newest
// <Name>.v<N>.avsc of the writer's record.  Prints one JSON object per file, in the same
// shape as decode_so.py (bytes as hex, timestamp-micros as int micros).
//
// Usage: java -cp <avro jars> DecodeSO.java <schemas dir> [--fingerprints] [FILE ...]
//   --fingerprints  also print "<file> <8 fingerprint bytes hex> <parsingFingerprint64 hex>"
//                   for every schema file (SchemaNormalization, CRC-64-AVRO)
// See README.md for the classpath (gen_fixtures.sh uses the same one).

import java.io.File;
import java.nio.ByteBuffer;
import java.nio.file.Files;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.TreeMap;
import java.util.regex.Matcher;
import java.util.regex.Pattern;

import org.apache.avro.Schema;
import org.apache.avro.SchemaNormalization;
import org.apache.avro.generic.GenericData;
import org.apache.avro.generic.GenericRecord;
import org.apache.avro.message.BinaryMessageDecoder;
import org.apache.avro.util.Utf8;
import org.codehaus.jackson.map.ObjectMapper;

public class DecodeSO {
    public static void main(String[] args) throws Exception {
        File dir = new File(args[0]);
        boolean printFp = false;
        List<String> files = new ArrayList<>();
        for (String a : Arrays.copyOfRange(args, 1, args.length)) {
            if (a.equals("--fingerprints")) printFp = true; else files.add(a);
        }
        Pattern re = Pattern.compile("^([A-Za-z]+)\\.v(\\d+)\\.avsc$");
        Map<String, String> fpToFile = new HashMap<>();
        Map<String, String> fpToRecord = new HashMap<>();
        Map<String, List<Schema>> versions = new HashMap<>();
        Map<String, Integer> newestVersion = new HashMap<>();
        Map<String, Schema> newest = new HashMap<>();
        TreeMap<String, String> table = new TreeMap<>();
        File[] all = dir.listFiles((d, n) -> n.endsWith(".avsc"));
        Arrays.sort(all);
        for (File f : all) {
            Matcher m = re.matcher(f.getName());
            if (!m.matches()) throw new IllegalArgumentException("bad schema file name " + f.getName());
            Schema s = new Schema.Parser().parse(f);
            String fp = hex(SchemaNormalization.parsingFingerprint("CRC-64-AVRO", s));
            fpToFile.put(fp, f.getName());
            fpToRecord.put(fp, s.getFullName());
            versions.computeIfAbsent(s.getFullName(), k -> new ArrayList<>()).add(s);
            int v = Integer.parseInt(m.group(2));
            if (!newestVersion.containsKey(s.getFullName()) || v > newestVersion.get(s.getFullName())) {
                newestVersion.put(s.getFullName(), v);
                newest.put(s.getFullName(), s);
            }
            table.put(f.getName(), fp + " 0x" + String.format("%016X", SchemaNormalization.parsingFingerprint64(s)));
        }
        Schema nullSchema = Schema.create(Schema.Type.NULL);
        String nullFp = hex(SchemaNormalization.parsingFingerprint("CRC-64-AVRO", nullSchema));
        fpToFile.put(nullFp, "\"null\"");
        fpToRecord.put(nullFp, "null");
        versions.put("null", Arrays.asList(nullSchema));
        newest.put("null", nullSchema);
        table.put("\"null\"", nullFp + " 0x" + String.format("%016X", SchemaNormalization.parsingFingerprint64(nullSchema)));
        if (printFp) for (Map.Entry<String, String> e : table.entrySet()) System.out.println(e.getKey() + " " + e.getValue());

        Map<String, BinaryMessageDecoder<Object>> decoders = new HashMap<>();
        for (String name : newest.keySet()) {
            BinaryMessageDecoder<Object> d = new BinaryMessageDecoder<>(GenericData.get(), newest.get(name));
            for (Schema w : versions.get(name)) d.addSchema(w);
            decoders.put(name, d);
        }
        ObjectMapper json = new ObjectMapper();
        int status = 0;
        for (String path : files) {
            byte[] data = Files.readAllBytes(new File(path).toPath());
            try {
                // pick the decoder by the record the fingerprint names; BinaryMessageDecoder
                // itself checks the C3 01 marker and resolves the fingerprint again
                String fp = data.length >= 10 ? hex(Arrays.copyOfRange(data, 2, 10)) : "";
                String record = fpToRecord.get(fp);
                if (record == null) throw new IllegalArgumentException("unknown schema fingerprint " + fp);
                Object datum = decoders.get(record).decode(data);
                Map<String, Object> out = new LinkedHashMap<>();
                out.put("file", path);
                out.put("schema", fpToFile.get(fp));
                out.put("fingerprint", fp);
                out.put("datum", toJson(datum, newest.get(record)));
                System.out.println(json.writeValueAsString(out));
            } catch (Exception e) {
                System.err.println(path + ": " + e);
                status = 1;
            }
        }
        System.exit(status);
    }

    static Object toJson(Object v, Schema s) {
        switch (s.getType()) {
            case NULL:
                return null;
            case UNION:
                return toJson(v, s.getTypes().get(GenericData.get().resolveUnion(s, v)));
            case RECORD: {
                Map<String, Object> m = new LinkedHashMap<>();
                for (Schema.Field f : s.getFields()) m.put(f.name(), toJson(((GenericRecord) v).get(f.name()), f.schema()));
                return m;
            }
            case ARRAY: {
                List<Object> out = new ArrayList<>();
                for (Object o : (Iterable<?>) v) out.add(toJson(o, s.getElementType()));
                return out;
            }
            case BYTES: {
                ByteBuffer b = ((ByteBuffer) v).duplicate();
                byte[] a = new byte[b.remaining()];
                b.get(a);
                return hex(a);
            }
            case STRING:
                return v.toString();
            default:
                return v;
        }
    }

    static String hex(byte[] a) {
        StringBuilder sb = new StringBuilder();
        for (byte x : a) sb.append(String.format("%02x", x & 0xFF));
        return sb.toString();
    }
}
